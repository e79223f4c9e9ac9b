"""`dsquant validate` and `dsquant demo`."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from dsquant.cli_options import device_option, kv_cache_dtype_option, tensor_parallel_option

DEMO_RECIPES = ("awq-w4g128", "gptq-w4g128", "fp8-block", "mixed-fp8attn-w4experts")


def _device(device: str | None) -> str:
    import torch

    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def _finish(rows, paths) -> None:
    from dsquant.validate.latency_report import latency_warnings
    from dsquant.validate.report import lm_eval_table, table

    sets = list(rows[0].accuracy)
    click.echo(table(rows, sets))
    if lm_eval_table(rows):
        click.echo("\nlm-eval (± standard error)\n" + lm_eval_table(rows))
    for key, path in paths.items():
        click.echo(f"{key}: {path}")
    for line in latency_warnings(rows):  # also in report.md; the exit status does not change
        click.echo(f"warning: {line}", err=True)
    lm_failed = [f"{r.name}: {n}" for r in rows for n in r.notes if n.startswith("lm-eval failed")]
    for line in lm_failed:  # a requested measurement is missing: the report has it as a note, exit 1
        click.echo(line, err=True)
    failed = [r.name for r in rows if r.failed_gate]
    if failed:
        click.echo(f"failed --max-ppl-increase: {', '.join(failed)}", err=True)
    if failed or lm_failed:
        sys.exit(1)


@click.command(short_help="Accuracy and latency of artifacts against their baseline.")
@click.argument("artifacts", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option("--baseline", required=True, type=click.Path(path_type=str), help="The unquantized checkpoint.")
@click.option("--eval", "eval_set", default="bundled", show_default=True,
              help="'bundled' (eval_prose + eval_code) or a .txt/.jsonl/.parquet/saved-dataset path.")
@click.option("--max-ppl-increase", type=float, default=None, help="Exit 1 if an artifact's perplexity rises more (%).")
@click.option("--out", "out_dir", default="dsquant-validate", show_default=True, type=click.Path(path_type=str),
              help="Report directory (report.md, report.json, plot).")
@device_option()
@click.option("--window", default=2048, show_default=True, type=int, help="Perplexity window (tokens).")
@click.option("--stride", default=None, type=int, help="Window stride (default: window / 2).")
@click.option("--max-eval-tokens", default=None, type=int, help="Evaluate only the first N tokens of each set.")
@click.option("--no-latency", is_flag=True, help="Accuracy only.")
@click.option("--latency-rounds", default=1, show_default=True, type=click.IntRange(min=1),
              help="Measure every artifact's latency this many times, interleaved (A B C, A B C); each figure "
                   "is the median over all rounds, so a slow spell of the machine falls on every artifact.")
@click.option("--num-scheduler-steps", default=1, show_default=True, type=click.IntRange(min=1),
              help="The latency engine's decode steps per launch (multi-step decoding; `dsquant serve` has it too).")
@click.option("--no-peers", is_flag=True, help="Skip the bitsandbytes NF4/INT8 peers.")
@click.option("--lm-eval", "lm_eval", default=None, metavar="TASKS",
              help="lm-evaluation-harness tasks (comma-separated names or YAML paths) run against `dsquant serve` "
                   "of the baseline and each artifact; bundled offline: dsq_prose_cloze, dsq_prose_choice, "
                   "dsq_prose_cloze_gen (tag dsquant). Needs pip install 'dsquant[lmeval]'.")
@click.option("--lm-eval-limit", default=None, type=click.IntRange(min=1), help="Examples per lm-eval task.")
@kv_cache_dtype_option()
@tensor_parallel_option()
def validate(artifacts, baseline, eval_set, max_ppl_increase, out_dir, device, window, stride,
             max_eval_tokens, no_latency, latency_rounds, num_scheduler_steps, no_peers, lm_eval, lm_eval_limit,
             kv_cache_dtype, tensor_parallel_size):
    """Accuracy (perplexity, KL, top-1) against latency (TTFT, TPOT, tok/s) for each ARTIFACT.

    With --kv-cache-dtype fp8 the artifacts run with the FP8 KV cache (the baseline with the model
    dtype's), and each artifact gets a second row, "NAME [KV fp8_e4m3 vs ...]": the same weights with
    the FP8 cache against the model-dtype cache, i.e. what the FP8 cache alone costs.

    With --tensor-parallel-size N > 1 every model (baseline included) is split over N processes and each
    window runs as one prefill through the serving engine; latency is measured at that size too."""
    from dataclasses import replace

    from dsquant.validate.latency import LatencySpec
    from dsquant.validate.runner import ValidateArgs, run_validate, set_cpu_threads

    if lm_eval_limit is not None and lm_eval is None:
        raise click.UsageError("--lm-eval-limit needs --lm-eval TASKS")
    device = _device(device)
    if device == "cpu":
        set_cpu_threads()
    args = ValidateArgs(list(artifacts), baseline, eval_set, max_ppl_increase, out_dir, device, window,
                        stride, max_eval_tokens, not no_latency, peers=not no_peers, lm_eval=lm_eval,
                        lm_eval_limit=lm_eval_limit, kv_cache_dtype=kv_cache_dtype,
                        tensor_parallel_size=tensor_parallel_size,
                        latency_spec=replace(LatencySpec.for_device(device), rounds=latency_rounds,
                                             num_scheduler_steps=num_scheduler_steps))
    _finish(*run_validate(args, log=lambda m: click.echo(m, err=True)))


@click.command(short_help="Quantize the bundled dsq-tiny-v3 four ways and validate them.")
@click.option("--out", "out_dir", default="dsquant-demo", show_default=True, type=click.Path(path_type=str),
              help="Directory for the artifacts and the report.")
@device_option()
def demo(out_dir, device):
    """Quantize the bundled dsq-tiny-v3 four ways and validate them all against BF16 (offline)."""
    from dsquant.assets import bundled_model_path
    from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize
    from dsquant.validate.runner import ValidateArgs, run_validate, set_cpu_threads

    device = _device(device)
    if device == "cpu":
        set_cpu_threads()
    base = bundled_model_path("dsq-tiny-v3")
    root = Path(out_dir)
    t0 = time.time()
    arts = []
    for recipe in DEMO_RECIPES:
        out = root / recipe
        if (out / "dsquant.json").is_file():
            click.echo(f"{recipe}: reusing {out}", err=True)
        else:
            click.echo(f"quantize {recipe} -> {out}", err=True)
            run_quantize(QuantizeArgs(str(base), recipe, str(out), n_samples=32, seqlen=512, device=device))
        arts.append(str(out))
    click.echo(f"quantized in {time.time() - t0:.0f} s", err=True)
    # dsq-tiny-v3 was trained on 512-token sequences: its context for evaluation
    args = ValidateArgs(arts, str(base), "bundled", None, str(root / "report"), device, window=512, stride=256,
                        max_eval_tokens=16384)
    _finish(*run_validate(args, log=lambda m: click.echo(m, err=True)))
    click.echo(f"demo finished in {time.time() - t0:.0f} s", err=True)
