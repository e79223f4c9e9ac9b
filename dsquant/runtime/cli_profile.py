"""`dsquant profile ART`: where a prefill and a decode step spend their time, by layer type."""
from __future__ import annotations

import click

from dsquant.cli_options import device_option


@click.command(short_help="Profile a prefill and N decode steps: Chrome trace, kernel time by layer type.")
@click.argument("artifact", type=str)
@click.option("--decode-steps", default=16, show_default=True, type=click.IntRange(min=1),
              help="Decode steps to profile after the prefill.")
@click.option("--prompt-len", default=128, show_default=True, type=click.IntRange(min=1),
              help="Prompt tokens of the profiled prefill (random ids).")
@click.option("--batch-size", default=1, show_default=True, type=click.IntRange(min=1),
              help="Concurrent requests (each with a --prompt-len prompt).")
@device_option()
@click.option("--out", "out_dir", default="dsquant-profile", show_default=True, type=click.Path(path_type=str),
              help="Writes trace.json (Chrome trace), profile.md and profile.json here.")
def profile(artifact, decode_steps, prompt_len, batch_size, device, out_dir):
    """Profile one prefill and N decode steps of ARTIFACT with torch.profiler.

    Writes a Chrome trace (OUT/trace.json) and prints the kernel time (CPU: operator self time) of
    each phase by layer type: attention, MLP/MoE, linear projections, norm/residual, sampler,
    other. Runs eagerly, without CUDA graphs, so every kernel is visible.
    """
    from dsquant.assets import resolve_model_dir
    from dsquant.runtime.profile import render, run_profile

    result = run_profile(resolve_model_dir(artifact), out_dir, device, prompt_len, decode_steps, batch_size)
    click.echo(render(result))
