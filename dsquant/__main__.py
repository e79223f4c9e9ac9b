"""`python -m dsquant` runs the CLI."""
from dsquant.cli import main

if __name__ == "__main__":  # tensor-parallel workers are spawned and re-import this module
    main()
