"""`dsquant bench ...`: benchmarks that time dsquant beside its peers in one run, on the same inputs.

Each submodule defines one click command and is registered in `register` below. Heavy imports
(torch, triton, kernels) happen inside the commands, so `dsquant --help` stays fast.
"""
import importlib

import click

# (module under dsquant.bench, command name); add a line when a benchmark works end to end.
COMMANDS: list[tuple[str, str]] = [
    ("attention", "attention"),
    ("moe", "moe"),
    ("gemm", "gemm"),
    ("serve", "serve"),
    ("engine", "engine"),
]


@click.group(name="bench")
def bench() -> None:
    """Benchmark kernels and the engine against their peers (GPU)."""


def register() -> click.Group:
    for module, name in COMMANDS:
        cmd = getattr(importlib.import_module(f"dsquant.bench.{module}"), name)
        bench.add_command(cmd)
    return bench
