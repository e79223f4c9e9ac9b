"""`python -m dsquant` runs the CLI."""
from dsquant.cli import main

main()
