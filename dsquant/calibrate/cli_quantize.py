"""The `dsquant quantize` command: progress bar over layers, summary table at the end."""
from __future__ import annotations

from collections import defaultdict

import click

from dsquant.calibrate.recipe import bundled_recipes


def _summary(report) -> str:
    """Error, time and memory per module type (layer/expert indices folded)."""
    from dsquant.models.summary import human, module_type

    manifest = report.manifest
    by_type: dict[str, list[float]] = defaultdict(list)
    for name, err in report.module_errors.items():
        by_type[module_type(name)].append(err)
    schemes = manifest["recipe"]
    width = max(len(t) for t in by_type) if by_type else 10
    lines = [f"{'module type':<{width}}  {'count':>5}  {'mean rel err':>12}  {'max rel err':>11}"]
    for t, errs in sorted(by_type.items()):
        lines.append(f"{t:<{width}}  {len(errs):>5}  {sum(errs) / len(errs):>12.4f}  {max(errs):>11.4f}")
    secs = [v["seconds"] for v in manifest["layers"].values()]
    lines += ["",
              f"recipe {schemes['name']} -> format {manifest['format']}; {len(secs)} layers in "
              f"{manifest['seconds_total']:.1f} s (slowest layer {max(secs, default=0):.1f} s)",
              f"peak memory: host {human(manifest['peak_host_bytes'], 'B')}, "
              f"device {human(manifest['peak_device_bytes'], 'B')}"]
    fallback = {k: v["fallback_experts"] for k, v in manifest["layers"].items() if v["fallback_experts"]}
    if fallback:
        lines.append(f"experts calibrated on all tokens (router picked them too rarely): {fallback}")
    return "\n".join(lines)


@click.command()
@click.argument("model_dir", type=click.Path(path_type=str))
@click.option("--recipe", required=True,
              help=f"Recipe YAML path or bundled name ({', '.join(r[:-5] for r in bundled_recipes())}).")
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(path_type=str), help="Artifact directory.")
@click.option("--calib", default=None, help="Calibration text (.txt, .jsonl, .parquet, saved dataset dir).")
@click.option("--n-samples", default=128, show_default=True, type=int)
@click.option("--seqlen", default=512, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--device", default=None, type=click.Choice(["cuda", "cpu"]), help="Default: cuda if present.")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
def quantize(model_dir, recipe, out_dir, calib, n_samples, seqlen, seed, device, force):
    """Calibrate MODEL_DIR layer by layer into an AWQ, GPTQ, FP8 block or mixed artifact."""
    import torch
    from tqdm import tqdm

    from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize
    from dsquant.cli import resolve_model_dir

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    args = QuantizeArgs(resolve_model_dir(model_dir), recipe, out_dir, calib, n_samples, seqlen, seed,
                        device, force)
    bar = None

    def progress(done, total, stats):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, initial=done - 1, desc="layers", unit="layer")
        bar.update(1)

    try:
        report = run_quantize(args, progress)
    finally:
        if bar is not None:
            bar.close()
    click.echo(_summary(report))
    click.echo(f"artifact: {report.out_dir}")
