"""The `dsquant` command line: a click group; subcommands are registered once they work."""
from __future__ import annotations

import logging
import sys

import click

from dsquant import __version__
from dsquant.assets import resolve_model_dir
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


@cli.command(short_help="Describe a checkpoint: architecture, layers, formats.")
@click.argument("model_dir", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def inspect(model_dir: str, as_json: bool) -> None:
    """Describe a checkpoint: architecture, layers, parameters, dtype and format per module type.

    MODEL_DIR is a checkpoint directory or the name of a bundled model (dsq-tiny-v3,
    dsq-tiny-qwen2). Every weight's name, shape and dtype is checked against config.json.
    """
    from dsquant.models.summary import render, summarize

    summary = summarize(resolve_model_dir(model_dir))
    if as_json:
        import json

        payload = {
            "path": summary.path, "architecture": summary.config.architecture,
            "num_hidden_layers": summary.config.num_hidden_layers,
            "dense_layers": summary.dense_layers, "moe_layers": summary.moe_layers,
            "num_params": summary.num_params, "disk_bytes": summary.disk_bytes,
            "module_types": {t: {"count": i.count, "params": i.params, "formats": dict(i.formats)}
                             for t, i in summary.module_types.items()},
            "quantization_config": summary.quantization,
            "quantization": summary.quantization_info(),
            "quantized_module_types": summary.quantized_types(),
            "calibration": summary.calibration_info(),
        }
        click.echo(json.dumps(payload, indent=1))
    else:
        click.echo(render(summary))


def _register() -> None:
    from dsquant.bench import register as register_bench
    from dsquant.calibrate.cli_quantize import quantize
    from dsquant.runtime.cli import generate
    from dsquant.runtime.cli_profile import profile
    from dsquant.runtime.server.cli_serve import serve
    from dsquant.tune.cli_tune import tune
    from dsquant.validate.cli_validate import demo, validate

    for command in (quantize, serve, validate, generate, demo, profile, tune):
        cli.add_command(command)
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
