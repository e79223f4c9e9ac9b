"""The proof: quantize the chosen recipe, validate it, and set the measurements beside the predictions.

1. `run_quantize` with the written recipe.yaml on the same calibration samples the search used.
2. The additive-KL check: the artifact's KL and NLL against BF16 on the very held-out calibration
   tokens the candidates were scored on (validate's `compare`), against the sum of the candidates' KL.
3. `run_validate` on the bundled evaluation sets (capped by --eval-tokens) with its latency
   measurement: perplexity increase, KL, TPOT at batch 1 and throughput at each batch size > 1, the
   same LatencySpec that timed the BF16 step for the fixed work, so predicted and measured compare.
   The --compare recipes (by default the bundled fp8-block and awq-w4g128) are quantized too and run
   in that same validate, so the chosen recipe is measured against them on the same inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from dsquant.validate.accuracy import compare


@dataclass
class ProofArgs:
    model_dir: str
    recipe_path: str
    out_dir: Path  # the tune output directory; the artifact goes to out_dir / "artifact"
    n_samples: int
    seqlen: int
    seed: int
    device: str
    eval_tokens: int
    window: int
    latency_spec: object  # validate.latency.LatencySpec


def _heldout_check(args: ProofArgs, artifact: Path, heldout: torch.Tensor) -> dict:
    """KL / NLL change of the artifact against BF16 on the held-out calibration tokens [h, T]."""
    from dsquant.models.loader import load_model

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    base = load_model(args.model_dir, dtype=dtype, device=args.device)
    quant = load_model(artifact, dtype=dtype, device=args.device)
    stream = heldout.reshape(-1)
    b, res = compare(base, {"tuned": quant}, stream, "heldout", args.seqlen, args.seqlen - 1, args.device)
    acc = res["tuned"]
    return {"kl": acc.kl_mean.value, "kl_low": acc.kl_mean.low, "kl_high": acc.kl_mean.high,
            "dnll": math.log(acc.perplexity.value / b.perplexity.value),
            "ppl_increase_pct": (acc.perplexity.value / b.perplexity.value - 1) * 100,
            "top1": acc.top1_agreement.value}


def _latency(row) -> dict:
    lat = row.latency or {}
    return {"tpot_us": lat.get("tpot_s", float("nan")) * 1e6,
            "throughput_tok_s": {int(b): v for b, v in (lat.get("throughput_tok_s") or {}).items()},
            "decode_split": {int(b): v for b, v in (lat.get("decode_split") or {}).items()},
            "kernel_fallbacks": list(lat.get("kernel_fallbacks") or [])}


def _eval(row, base) -> dict:
    sets = list(row.accuracy)
    kl = sum(row.accuracy[s]["kl_mean"]["value"] for s in sets) / len(sets)
    return {"sets": sets, "ppl_increase_pct": row.ppl_increase_pct, "kl": kl,
            "per_set": {s: {"ppl": row.accuracy[s]["perplexity"]["value"],
                            "base_ppl": base.accuracy[s]["perplexity"]["value"],
                            "kl": row.accuracy[s]["kl_mean"]["value"],
                            "top1": row.accuracy[s]["top1_agreement"]["value"]} for s in sets}}


def run_proof(args: ProofArgs, heldout: torch.Tensor, log=print, compare: list[str] = ()) -> dict:
    """Quantize and validate the chosen recipe, and each recipe of `compare` (bundled names or paths)
    beside it in the same validate run (same inputs, same LatencySpec), so the chosen one's speed and
    accuracy stand against theirs measured, not only predicted."""
    from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize
    from dsquant.validate.runner import ValidateArgs, run_validate

    def quantize(recipe: str, out: Path):
        return run_quantize(QuantizeArgs(args.model_dir, recipe, str(out), n_samples=args.n_samples,
                                         seqlen=args.seqlen, seed=args.seed, device=args.device, force=True))

    artifact = args.out_dir / "artifact"
    log(f"proof: quantizing with {args.recipe_path} -> {artifact}")
    report = quantize(args.recipe_path, artifact)
    others = {}
    for name in compare:
        out = args.out_dir / "compare" / Path(name).stem
        log(f"proof: quantizing the compared recipe {name} -> {out}")
        others[name] = quantize(name, out)
    log("proof: held-out KL of the quantized recipe")
    heldout_acc = _heldout_check(args, artifact, heldout)
    log("proof: validate (accuracy on the evaluation sets, latency)")
    paths_in = [str(artifact)] + [str(r.out_dir) for r in others.values()]
    rows, paths = run_validate(ValidateArgs(paths_in, args.model_dir, max_eval_tokens=args.eval_tokens,
                                            out_dir=str(args.out_dir / "validate"), device=args.device,
                                            window=args.window, latency_spec=args.latency_spec, peers=False),
                               log=log)
    base, tuned = rows[0], rows[1]
    compared = {name: {"artifact": str(r.out_dir), "format": r.manifest["format"], "disk_bytes": row.disk_bytes,
                       "eval": _eval(row, base), "latency": _latency(row)}
                for (name, r), row in zip(others.items(), rows[2:])}
    return {"artifact": str(report.out_dir), "format": report.manifest["format"],
            "disk_bytes": tuned.disk_bytes, "heldout": heldout_acc, "eval": _eval(tuned, base),
            "latency": _latency(tuned), "baseline_latency": _latency(base), "compared": compared,
            "validate_report": str(paths.get("md", ""))}
