"""H200 probe of fused_moe's decode rules for grouped-GEMM experts (V2-Lite layer, bf16 and fp8).

    python scripts/moe_fp8_quant_probe.py OUT.json [--tokens 1,2,8,64] [--layers 8]

fused_moe skips moe_align for batches of at most ONE_BLOCK_PER_PAIR_MAX_TOKENS tokens (one block per
pair) and, for fp8 experts, quantizes the activations inside the grouped GEMMs for at most
FP8_FUSE_QUANT_MAX_TOKENS tokens. For each token count this times expert_outputs (align or not,
quant launches or not, both GEMMs; no moe_sum) as CUDA-graph replays over `--layers` weight copies
(read from HBM, not L2) in every combination of the two rules, checks each against the default
form's output, and reports the bytes of the experts read over each time against 4.25 TB/s.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton.testing as tt

import dsquant.runtime.kernels.moe.fused_moe as fm
from dsquant.bench.common import environment
from dsquant.bench.moe import ROOFLINE_GBS, _random_dense, _routing, build_layer, expert_bytes

FORMS = {"align+prequant": (0, 0), "pairs+prequant": (10 ** 9, 0), "align+fused": (0, 10 ** 9),
         "pairs+fused": (10 ** 9, 10 ** 9)}  # (ONE_BLOCK_PER_PAIR_MAX_TOKENS, FP8_FUSE_QUANT_MAX_TOKENS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", default="1,2,8,64")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--formats", default="fp8,bf16")
    args = ap.parse_args()
    dev, gen = "cuda", torch.Generator(device="cuda").manual_seed(0)
    dense = [_random_dense(dev, gen) for _ in range(args.layers)]
    rows = []
    for fmt in args.formats.split(","):
        layers = [build_layer(fmt, d, dev) for d in dense]
        per_expert = expert_bytes(layers[0])
        for t in map(int, args.tokens.split(",")):
            routing = [_routing(t, dev, gen) for _ in range(args.layers)]  # (x, tw, ids, (tw8, ids8))
            active = sum(sum(per_expert[e] for e in torch.unique(r[3][1]).tolist()) for r in routing) / args.layers
            saved = (fm.ONE_BLOCK_PER_PAIR_MAX_TOKENS, fm.FP8_FUSE_QUANT_MAX_TOKENS)
            base = [fm.expert_outputs(r[0], w, r[3][1]) for r, w in zip(routing, layers)]
            for form, (pair_max, fuse_max) in FORMS.items():
                if fmt != "fp8" and fuse_max:
                    continue
                fm.ONE_BLOCK_PER_PAIR_MAX_TOKENS, fm.FP8_FUSE_QUANT_MAX_TOKENS = pair_max, fuse_max
                try:
                    fn = lambda: [fm.expert_outputs(r[0], w, r[3][1]) for r, w in zip(routing, layers)]  # noqa: E731
                    outs = fn()
                    err = max(float((o.float() - b.float()).norm() / b.float().norm()) for o, b in zip(outs, base))
                    us = tt.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3 / args.layers
                finally:
                    fm.ONE_BLOCK_PER_PAIR_MAX_TOKENS, fm.FP8_FUSE_QUANT_MAX_TOKENS = saved
                gbs = active / us / 1e3
                rows.append({"format": fmt, "tokens": t, "form": form, "us": us, "active_mb": active / 1e6,
                             "gbs": gbs, "roofline_frac": gbs / ROOFLINE_GBS, "rel_err_vs_default": err})
                print(f"{fmt} T={t:3d} {form:15s} {us:7.2f} us  {gbs:6.0f} GB/s ({gbs / ROOFLINE_GBS:5.1%})  "
                      f"err vs default {err:.2e}", flush=True)
        del layers
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"env": environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
