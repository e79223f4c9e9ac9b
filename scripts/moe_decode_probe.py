"""H200 probe of fused_moe's decode forms (V2-Lite layer: 64 + 2 shared experts, top-6, H 2048, I 1408).

    python scripts/moe_decode_probe.py OUT.json [--tokens 1,2,8,64] [--layers 8] [--formats fp8,bf16,int4]

Each form runs expert_outputs' work (both expert GEMMs and whatever they need; no moe_sum), timed as
CUDA-graph replays over `--layers` weight copies (read from HBM, not L2), checked against the default
form's output (rel_err_vs_default), with the bytes of the experts read over the time against 4.25 TB/s.
- bf16 / fp8: expert_outputs under every combination of fused_moe's two decode rules (module
  constants, forced on or off for the call): "align" or "pairs" (ONE_BLOCK_PER_PAIR_MAX_TOKENS: the
  moe_align launch or one block per pair), and for fp8 "prequant" or "fused"
  (FP8_FUSE_QUANT_MAX_TOKENS: two quant launches, or the activations quantized inside the GEMMs).
- int4: the default (the per-pair GEMVs for <= MOE_GEMV_MAX_PAIRS pairs, else align + grouped MMA),
  and the grouped MMA GEMM (paired dequantization, weights as the dot's register operand) on one
  block per pair at each of MMA_CONFIGS: whether tensor cores beat the GEMV's FMAs at decode.
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
from dsquant.runtime.kernels.moe.moe_align import one_block_per_pair
from dsquant.runtime.kernels.moe.moe_gemm import GemmConfig, moe_gemm

RULES = {"align+prequant": (0, 0), "pairs+prequant": (10 ** 9, 0), "align+fused": (0, 10 ** 9),
         "pairs+fused": (10 ** 9, 10 ** 9)}  # (ONE_BLOCK_PER_PAIR_MAX_TOKENS, FP8_FUSE_QUANT_MAX_TOKENS)
MMA_CONFIGS = [(16, 16, 128, 1, 3), (16, 32, 128, 1, 3), (16, 32, 128, 2, 3), (16, 64, 128, 2, 3),
               (16, 64, 128, 4, 3), (16, 128, 128, 4, 3)]  # (block_m, block_n, block_k, warps, stages)


def with_rules(pair_max: int, fuse_max: int):
    """expert_outputs with fused_moe's two decode rules set for the call."""
    def run(x, w, ids):
        saved = (fm.ONE_BLOCK_PER_PAIR_MAX_TOKENS, fm.FP8_FUSE_QUANT_MAX_TOKENS)
        fm.ONE_BLOCK_PER_PAIR_MAX_TOKENS, fm.FP8_FUSE_QUANT_MAX_TOKENS = pair_max, fuse_max
        try:
            return fm.expert_outputs(x, w, ids)
        finally:
            fm.ONE_BLOCK_PER_PAIR_MAX_TOKENS, fm.FP8_FUSE_QUANT_MAX_TOKENS = saved
    return run


def mma_pair_blocks(cfg: GemmConfig):
    """Both grouped GEMMs on one block per pair (no align), at cfg."""
    def run(x, w, ids):
        top_k = ids.shape[1]
        align = one_block_per_pair(ids, cfg.block_m)
        act = torch.empty(ids.numel(), w.w13.n // 2, dtype=x.dtype, device=x.device)
        out = torch.empty(ids.numel(), w.w2.n, dtype=x.dtype, device=x.device)
        moe_gemm(x, w.w13, align, act, cfg, a_row_div=top_k, gated=True)
        moe_gemm(act, w.w2, align, out, cfg, a_row_div=1, gated=False)
        return out.view(x.shape[0], top_k, -1)
    return run


def forms(fmt: str) -> dict:
    if fmt == "int4":
        return {"default": fm.expert_outputs,
                **{f"pairs+mma{c}": mma_pair_blocks(GemmConfig(*c)) for c in MMA_CONFIGS}}
    rules = RULES if fmt == "fp8" else {k: v for k, v in RULES.items() if k.endswith("prequant")}
    return {"default": fm.expert_outputs, **{k: with_rules(*v) for k, v in rules.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", default="1,2,8,64")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--formats", default="fp8,bf16,int4")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run under TRITON_INTERPRET at a small "
                    "layer (8 + 2 experts, H 256, I 128), each form run once and checked, not timed")
    args = ap.parse_args()
    dev, gen = args.device, torch.Generator(device=args.device).manual_seed(0)
    if dev == "cpu":
        import dsquant.bench.moe as bench_moe
        bench_moe.E, bench_moe.H, bench_moe.I = 8, 256, 128
    dense = [_random_dense(dev, gen) for _ in range(args.layers)]
    rows = []
    for fmt in args.formats.split(","):
        layers = [build_layer(fmt, d, dev) for d in dense]
        per_expert = expert_bytes(layers[0])
        for t in map(int, args.tokens.split(",")):
            routing = [_routing(t, dev, gen) for _ in range(args.layers)]  # (x, tw, ids, (tw8, ids8))
            active = sum(sum(per_expert[e] for e in torch.unique(r[3][1]).tolist()) for r in routing) / args.layers
            base = [fm.expert_outputs(r[0], w, r[3][1]) for r, w in zip(routing, layers)]
            for name, form in forms(fmt).items():
                try:
                    fn = lambda form=form: [form(r[0], w, r[3][1]) for r, w in zip(routing, layers)]  # noqa: E731
                    outs = fn()
                    err = max(float((o.float() - b.float()).norm() / b.float().norm()) for o, b in zip(outs, base))
                    us = (tt.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3 / args.layers
                          if dev == "cuda" else float("nan"))
                except Exception as exc:  # a config that does not compile or fit is reported, not fatal
                    print(f"{fmt} T={t} {name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    continue
                gbs = active / us / 1e3
                rows.append({"format": fmt, "tokens": t, "form": name, "us": us, "active_mb": active / 1e6,
                             "gbs": gbs, "roofline_frac": gbs / ROOFLINE_GBS, "rel_err_vs_default": err})
                print(f"{fmt} T={t:3d} {name:32s} {us:7.2f} us  {gbs:6.0f} GB/s ({gbs / ROOFLINE_GBS:5.1%})  "
                      f"err vs default {err:.2e}", flush=True)
        del layers
        if dev == "cuda":
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps({"env": environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
