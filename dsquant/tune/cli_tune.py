"""The `dsquant tune` command: options -> TuneArgs -> runner.run_tune, a summary line at the end."""
from __future__ import annotations

import click

from dsquant.cli_options import device_option
from dsquant.errors import DsquantError
from dsquant.tune.latency import CACHE_DIR
from dsquant.tune.space import SCHEMES, parse_schemes


def parse_batches(text: str) -> list[int]:
    try:
        batches = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        batches = []
    if not batches or batches[0] < 1:
        raise DsquantError(f"--batch {text}: expected comma-separated batch sizes >= 1, such as 1,64")
    return batches


def parse_compare(text: str) -> list[str]:
    """'fp8-block,awq-w4g128' -> the recipes, each checked to load; 'none' or '' -> []."""
    from dsquant.calibrate.recipe import load_recipe

    names = [] if text.strip().lower() in ("", "none") else [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        try:
            load_recipe(name)
        except DsquantError as e:
            raise DsquantError(f"--compare {name}: {e}") from None
    return names


@click.command(short_help="Choose a recipe from measured accuracy and measured latency.")
@click.argument("model_dir", type=click.Path(path_type=str))
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(path_type=str),
              help="Output directory: recipe.yaml, tune.json, tune.md, pareto.png (and artifact/, validate/).")
@click.option("--max-ppl-increase", type=float, default=None, metavar="PERCENT",
              help="Accuracy budget: predicted perplexity increase, percent.")
@click.option("--max-kl", type=float, default=None, metavar="NATS",
              help="Accuracy budget: predicted mean KL(BF16 || quantized) per held-out token.")
@click.option("--max-weight-gb", type=float, default=None, metavar="GB", help="Cap on the model's weight bytes (1e9).")
@click.option("--batch", "batch", default="1,64", show_default=True,
              help="Batch sizes the latency is predicted at (TPOT at 1, throughput above).")
@click.option("--schemes", default=",".join(SCHEMES), show_default=True, help="Schemes each group may take.")
@click.option("--band", default=1, show_default=True, type=int, help="Consecutive layers per unit of the search.")
@click.option("--latency-table", default=None, type=click.Path(exists=True, dir_okay=False, path_type=str),
              help="A recorded latency table (JSON, e.g. timed on a GPU) instead of timing here.")
@click.option("--latency-cache", default=str(CACHE_DIR), show_default=True, type=click.Path(path_type=str),
              help="Where measured latency tables are cached (one per device name and dsquant version).")
@click.option("--cpu-latency", default="runtime", show_default=True, type=click.Choice(["runtime", "dequant"]),
              help="On CPU, time the runtime's CPU path (weights dequantized at load) or a dequantize per call.")
@click.option("--n-samples", default=32, show_default=True, type=click.IntRange(min=1), help="Calibration sequences.")
@click.option("--seqlen", default=256, show_default=True, type=click.IntRange(min=3), help="Tokens per sequence.")
@click.option("--heldout", "n_heldout", default=8, show_default=True, type=click.IntRange(min=1),
              help="Held-out calibration sequences the candidates' KL is measured on.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the calibration draw.")
@click.option("--awq-grid", default=20, show_default=True, type=click.IntRange(min=1),
              help="AWQ scale and clip grid of the candidates (quantize's default is 20).")
@click.option("--eval-tokens", default=8192, show_default=True, type=click.IntRange(min=16),
              help="Proof: evaluation tokens per bundled eval set.")
@click.option("--window", default=512, show_default=True, type=click.IntRange(min=3), help="Proof: eval window.")
@click.option("--compare", default="fp8-block,awq-w4g128", show_default=True,
              help="Recipes (bundled names or paths) quantized and measured beside the chosen one in the proof, "
                   "their predictions in tune.md; 'none' for none.")
@click.option("--no-proof", is_flag=True, help="Skip quantizing and validating the chosen recipe.")
@click.option("--num-scheduler-steps", default=1, show_default=True, type=click.IntRange(min=1),
              help="The engine's decode steps per launch (multi-step decoding) in the timing and the proof.")
@device_option()
def tune(model_dir, out_dir, max_ppl_increase, max_kl, max_weight_gb, batch, schemes, band, latency_table,
         latency_cache, cpu_latency, n_samples, seqlen, n_heldout, seed, awq_grid, eval_tokens, window, compare,
         no_proof, num_scheduler_steps, device):
    """Find the fastest recipe for MODEL_DIR within an accuracy budget (and a weight cap).

    Every module group of every layer (attention input projections, q_b, kv_b, o_proj, shared
    experts, routed experts, dense MLP; q/k/v for GQA) may take bf16, fp8_block, awq g128 or awq g64;
    the KL each choice costs is measured, the latency of each is timed (or read from
    --latency-table), and the cheapest plan is searched exactly. The recipe is then quantized and
    validated (unless --no-proof), predicted beside measured in tune.md.
    """
    import torch

    from dsquant.assets import resolve_model_dir
    from dsquant.tune.runner import TuneArgs, run_tune
    from dsquant.validate.runner import set_cpu_threads

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        set_cpu_threads()
    args = TuneArgs(resolve_model_dir(model_dir), out_dir, max_ppl_increase, max_kl, max_weight_gb,
                    parse_batches(batch), parse_schemes(schemes), band, device, latency_table, latency_cache,
                    cpu_latency, n_samples, seqlen, n_heldout, seed, awq_grid, eval_tokens, window, not no_proof,
                    parse_compare(compare), num_scheduler_steps)
    payload = run_tune(args, log=lambda m: click.echo(m, err=True))
    pred = payload["chosen"]["predicted"]
    click.echo(f"chosen: predicted KL {pred['kl']:.4g}, ppl +{pred['ppl_increase_pct']:.3g}%, "
               + ", ".join(f"step b{b} {us / 1e3:.3g} ms" for b, us in pred["step_us"].items())
               + f", {pred['weight_gb']:.4f} GB")
    proof = payload["proof"]
    if proof is not None:
        click.echo(f"measured: held-out KL {proof['heldout']['kl']:.4g}, "
                   f"eval ppl +{proof['eval']['ppl_increase_pct']:.3g}%, "
                   f"TPOT {proof['latency']['tpot_us'] / 1e3:.3g} ms")
    click.echo(f"wrote {out_dir}/recipe.yaml, tune.json, tune.md, pareto.png")
