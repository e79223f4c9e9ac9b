"""The `dsquant` command line: a click group; subcommands are registered once they work."""
from __future__ import annotations

import logging
import sys

import click

from dsquant import __version__
from dsquant.errors import DsquantError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dsquant")
@click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """dsquant: quantize, serve and validate DeepSeek models."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


def _register() -> None:
    from dsquant.bench import register as register_bench
    from dsquant.inspect_cmd import inspect

    cli.add_command(inspect)
    bench = register_bench()
    if bench.commands:
        cli.add_command(bench)


_register()


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors print one line and exit 2; --debug shows the traceback."""
    args = sys.argv[1:] if argv is None else argv
    try:
        cli.main(args=args, prog_name="dsquant", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except DsquantError as e:
        if "--debug" in args:
            raise
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    sys.exit(0)
