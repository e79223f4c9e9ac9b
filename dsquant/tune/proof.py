"""The proof: quantize the chosen recipe, validate it, and set the measurements beside the predictions.

1. `run_quantize` with the written recipe.yaml on the same calibration samples the search used.
2. The additive-KL check: the artifact's KL and NLL against BF16 on the very held-out calibration
   tokens the candidates were scored on (validate's `compare`), against the sum of the candidates' KL.
3. `run_validate` on the bundled evaluation sets (capped by --eval-tokens) with its latency
   measurement: perplexity increase, KL, TPOT at batch 1 and throughput at each batch size > 1, the
   same LatencySpec that timed the BF16 step for the fixed work, so predicted and measured compare.
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


def run_proof(args: ProofArgs, heldout: torch.Tensor, log=print) -> dict:
    from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize
    from dsquant.validate.runner import ValidateArgs, run_validate

    artifact = args.out_dir / "artifact"
    log(f"proof: quantizing with {args.recipe_path} -> {artifact}")
    report = run_quantize(QuantizeArgs(args.model_dir, args.recipe_path, str(artifact), n_samples=args.n_samples,
                                       seqlen=args.seqlen, seed=args.seed, device=args.device, force=True))
    log("proof: held-out KL of the quantized recipe")
    heldout_acc = _heldout_check(args, artifact, heldout)
    log("proof: validate (accuracy on the evaluation sets, latency)")
    rows, paths = run_validate(ValidateArgs([str(artifact)], args.model_dir, max_eval_tokens=args.eval_tokens,
                                            out_dir=str(args.out_dir / "validate"), device=args.device,
                                            window=args.window, latency_spec=args.latency_spec, peers=False),
                               log=log)
    base, tuned = rows[0], rows[1]
    sets = list(tuned.accuracy)
    kl = sum(tuned.accuracy[s]["kl_mean"]["value"] for s in sets) / len(sets)

    def latency(row) -> dict:
        lat = row.latency or {}
        return {"tpot_us": lat.get("tpot_s", float("nan")) * 1e6,
                "throughput_tok_s": {int(b): v for b, v in (lat.get("throughput_tok_s") or {}).items()}}

    return {"artifact": str(report.out_dir), "format": report.manifest["format"],
            "disk_bytes": tuned.disk_bytes, "heldout": heldout_acc,
            "eval": {"sets": sets, "ppl_increase_pct": tuned.ppl_increase_pct, "kl": kl,
                     "per_set": {s: {"ppl": tuned.accuracy[s]["perplexity"]["value"],
                                     "base_ppl": base.accuracy[s]["perplexity"]["value"],
                                     "kl": tuned.accuracy[s]["kl_mean"]["value"],
                                     "top1": tuned.accuracy[s]["top1_agreement"]["value"]} for s in sets}},
            "latency": latency(tuned), "baseline_latency": latency(base),
            "validate_report": str(paths.get("md", ""))}
