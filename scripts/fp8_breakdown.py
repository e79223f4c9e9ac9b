"""Where FP8 block's accuracy cost comes from (issue 20): weights vs activations, and per module type.

    python scripts/fp8_breakdown.py BASELINE FP8_ARTIFACT --out DIR [--max-eval-tokens 4096]
        [--window 1024] [--stride 512] [--sweep-tokens 2048] [--types q_proj,k_proj,...]
        [--sweep-modes w8a8,w8a16] [--no-end-to-end]

Every row is scored against the baseline on the same windows (dsquant.validate.accuracy.compare,
the models built as `dsquant validate` builds them), so its figures compare with validate's:
  w8a8           the artifact as served: e4m3 weights in 128x128 blocks, activations quantized
                 per token and 128 channels, dynamically (FP8BlockMethod.dynamic_activations)
  w8a16          the same weights, activations unquantized (dynamic_activations off: the CPU path
                 multiplies the fp32 dequantized weight by the unquantized input)
  w16a8          the baseline's weights, the artifact's activation quantization only
  <mode>:<type>  (the sweep, on the first --sweep-tokens tokens) the baseline with only the
                 <type> Linears (q_proj, ...) the artifact's, in mode w8a8 or w8a16 (--sweep-modes);
                 <mode>:all is the whole artifact in that mode on the same tokens
Writes DIR/fp8_breakdown.json and DIR/fp8_breakdown.md.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dsquant.data import eval_tokens
from dsquant.data.tokenizer import load_tokenizer
from dsquant.runtime.layers.linear import QuantLinear
from dsquant.runtime.layers.quant import FP8BlockMethod
from dsquant.validate.accuracy import compare
from dsquant.validate.runner import BUNDLED_EVAL, _runtime_model

TYPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fp8_linears(model) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear) and isinstance(m.method, FP8BlockMethod)}


def weight_only(model):
    """W8A16: every FP8 Linear multiplies its unquantized input (CPU: the fp32 dequantized weight)."""
    for m in _fp8_linears(model).values():
        m.method.dynamic_activations = False
    return model


def activations_only(model, baseline):
    """W16A8: the FP8 Linears keep their activation quantization, with the baseline's weights."""
    base = dict(baseline.named_modules())
    for n, m in _fp8_linears(model).items():
        m.cpu_weight = base[n].weight.detach().to(torch.float32)  # [N, K]
    return model


def only_type(baseline_path: str, fp8_model, kind: str):
    """The baseline with only the `kind` Linears swapped for the FP8 model's (shared, not copied)."""
    model = _runtime_model(baseline_path, "cpu")
    for n, m in _fp8_linears(fp8_model).items():
        if n.endswith("." + kind):
            parent, _, child = n.rpartition(".")
            setattr(model.get_submodule(parent), child, m)
    return model


def _rows(baseline, models: dict, streams: dict, window: int, stride: int) -> dict:
    out: dict = {"baseline": {}}
    for s, tokens in streams.items():
        base, res = compare(baseline, models, tokens, s, window, stride, "cpu")
        for name, acc in res.items():
            out.setdefault(name, {})[s] = {
                "tokens": int(tokens.numel()), "ppl": acc.perplexity.value,
                "ppl_increase_pct": (acc.perplexity.value / base.perplexity.value - 1) * 100,
                "kl_mean": acc.kl_mean.value, "kl_p99": acc.kl_p99, "top1": acc.top1_agreement.value}
        out["baseline"][s] = {"tokens": int(tokens.numel()), "ppl": base.perplexity.value}
    return out


def _table(rows: dict, title: str) -> list[str]:
    lines = [f"### {title}", "", "| row | set | tokens | ppl | ppl +% | KL mean | KL p99 | top-1 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, sets in rows.items():
        for s, r in sets.items():
            if name == "baseline":
                lines.append(f"| baseline | {s} | {r['tokens']} | {r['ppl']:.3f} | - | - | - | - |")
            else:
                lines.append(f"| {name} | {s} | {r['tokens']} | {r['ppl']:.3f} | {r['ppl_increase_pct']:+.2f}% | "
                             f"{r['kl_mean']:.4f} | {r['kl_p99']:.4f} | {r['top1']:.3f} |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("baseline")
    ap.add_argument("artifact")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-eval-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--sweep-tokens", type=int, default=2048, help="eval tokens per set of the per-type sweep (0: none)")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--sweep-modes", default="w8a8", help="comma list of w8a8, w8a16: the swapped Linears' mode")
    ap.add_argument("--no-end-to-end", action="store_true", help="the per-type sweep only")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(args.baseline)
    streams = {s: eval_tokens(tokenizer, s, max_tokens=args.max_eval_tokens) for s in BUNDLED_EVAL}
    baseline = _runtime_model(args.baseline, "cpu")
    fp8 = _runtime_model(args.artifact, "cpu")
    result = {"baseline": args.baseline, "artifact": args.artifact, "window": args.window, "stride": args.stride}
    md = [f"# FP8 block breakdown: {args.artifact}", "",
          f"Baseline {args.baseline}; CPU, float32 evaluation; window {args.window}, stride {args.stride}.", ""]
    if not args.no_end_to_end:
        t0 = time.time()
        models = {"w8a8": fp8, "w8a16": weight_only(_runtime_model(args.artifact, "cpu")),
                  "w16a8": activations_only(_runtime_model(args.artifact, "cpu"), baseline)}
        result["end_to_end"] = _rows(baseline, models, streams, args.window, args.stride)
        md += _table(result["end_to_end"], f"End to end ({args.max_eval_tokens} tokens per set, {time.time() - t0:.0f} s)")
        del models
    if args.sweep_tokens:
        t0 = time.time()
        small = {s: t[: args.sweep_tokens] for s, t in streams.items()}
        result["per_type"] = {}
        for mode in args.sweep_modes.split(","):  # one mode at a time: each row holds a whole model
            source = fp8 if mode == "w8a8" else weight_only(_runtime_model(args.artifact, "cpu"))
            models = {f"{mode}:all": source, **{f"{mode}:{k}": only_type(args.baseline, source, k)
                                                for k in args.types.split(",")}}
            result["per_type"].update(_rows(baseline, models, small, args.window, args.stride))
            del models, source
        md += _table(result["per_type"], f"Only one module type FP8 ({args.sweep_tokens} tokens per set, "
                                         f"{time.time() - t0:.0f} s)")
    (out / "fp8_breakdown.json").write_text(json.dumps(result, indent=1))
    (out / "fp8_breakdown.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
