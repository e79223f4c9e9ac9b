"""GPU probe: FP8 experts at decode, the grouped GEMM on one block per pair (what fused_moe runs) against
the pair MMA with split-K (moe_pair_mma.moe_pair_mma_fp8), V2-Lite layer.

    python scripts/moe_pair_fp8_probe.py OUT.json [--tokens 1,2] [--layers 8]

Each projection (gate/up, down) is timed as CUDA-graph replays over `--layers` weight copies (read from
HBM, not L2), on activations quantized once outside the timed region (both forms take the same e4m3 codes
and scales), with its error against the float32 product of the dequantized experts and the bytes of the
experts the pairs read over each time against the 4.25 TB/s roofline. The "grouped" row is fused_moe's
config (pick_configs); "pair" rows sweep (block_n, warps, split_k, block_m).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton.testing as tt

from dsquant.bench.common import environment
from dsquant.bench.moe import E, H, I, N_SHARED, ROOFLINE_GBS, TOP_K, _random_dense, _routing, build_layer
from dsquant.runtime.kernels.moe.fused_moe import pick_configs
from dsquant.runtime.kernels.moe.fused_moe_fp8 import quantize_act_fp8
from dsquant.runtime.kernels.moe.moe_align import one_block_per_pair
from dsquant.runtime.kernels.moe.moe_gemm import moe_gemm
from dsquant.runtime.kernels.moe.moe_gemv import default_split_k, effective_split
from dsquant.runtime.kernels.moe.moe_pair_mma import moe_pair_mma_fp8
from dsquant.runtime.kernels.moe.reference_moe import dequantize_fp8_experts

PAIR_CONFIGS = [(64, 4, None, 16), (64, 4, 4, 16), (32, 4, None, 64), (64, 4, None, 64), (64, 4, 2, 64),
                (64, 4, 4, 64), (128, 4, None, 64), (128, 4, 4, 64)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", default="1,2")
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    dev, gen = "cuda", torch.Generator(device="cuda").manual_seed(0)
    weights = [build_layer("fp8", _random_dense(dev, gen), dev) for _ in range(args.layers)]
    rows = []
    for t in map(int, args.tokens.split(",")):
        routing = [_routing(t, dev, gen)[3] for _ in range(args.layers)]  # (topk_weights, ids) with shared
        top_k = TOP_K + N_SHARED
        pairs = t * top_k
        for gated in (True, False):
            n_out, k = (I, H) if gated else (H, I)
            div = top_k if gated else 1
            calls = []
            for w, (tw, ids) in zip(weights, routing):
                g = w.w13 if gated else w.w2
                a = torch.randn(t if gated else pairs, k, device=dev, generator=gen).to(torch.bfloat16)
                aq, a_s = quantize_act_fp8(a)
                out = torch.full((pairs, n_out), float("nan"), device=dev, dtype=torch.bfloat16)
                calls.append((aq, a_s, g, ids.contiguous(), out, tw))
            aq, a_s, g, ids, out, tw = calls[0]
            used, slot = torch.unique(ids.reshape(-1), return_inverse=True)  # the experts the pairs read
            dense = dequantize_fp8_experts(g.weight[used], g.scales[used]).float()  # [U, N, K]
            a32 = aq.float() * a_s.repeat_interleave(128, dim=1)[:, :k]
            rows_a = a32[torch.arange(pairs, device=dev) // div]
            y = torch.einsum("pk,pnk->pn", rows_a, dense[slot])  # [P, N]
            ref = torch.nn.functional.silu(y[:, :n_out]) * y[:, n_out:] if gated else y
            nbytes = sum(len(torch.unique(c[3])) * (c[2].weight[0].numel() + 4 * c[2].scales[0].numel())
                         for c in calls) / len(calls)
            cfg13, cfg2 = pick_configs(pairs, E + N_SHARED, "fp8")
            cfg = cfg13 if gated else cfg2

            def grouped(c):
                aq_, a_s_, g_, ids_, out_, _ = c
                moe_gemm(aq_, g_, one_block_per_pair(ids_, cfg.block_m), out_, cfg, a_row_div=div, gated=gated,
                         a_scale=a_s_)

            forms = [("grouped", dict(block_n=cfg.block_n, warps=cfg.num_warps, block_m=cfg.block_m), grouped)]
            for bn, warps, split, bm in PAIR_CONFIGS:
                def pair(c, bn=bn, warps=warps, split=split, bm=bm):
                    aq_, a_s_, g_, ids_, out_, _ = c
                    moe_pair_mma_fp8(aq_, a_s_, g_, ids_, out_, div, gated, None, bn, warps, split, block_m=bm)
                chunks = -(-k // 128)
                used = effective_split(split, chunks) if split else default_split_k(pairs, n_out, k, bn)
                forms.append(("pair", dict(block_n=bn, warps=warps, block_m=bm, split_k=used), pair))
            for kernel, cfg_row, fn in forms:
                out.fill_(float("nan"))
                fn(calls[0])
                r = dict(kernel=kernel, tokens=t, projection="gate_up" if gated else "down", **cfg_row,
                         rel_err=float((out.float() - ref).norm() / ref.norm()), bytes=nbytes)
                us = tt.do_bench_cudagraph(lambda: [fn(c) for c in calls], rep=50, return_mode="median") * 1e3
                r["us"] = us / len(calls)
                r["roofline"] = nbytes / r["us"] / 1e3 / ROOFLINE_GBS
                rows.append(r)
                print(json.dumps(r), flush=True)
    with open(args.out, "w") as f:
        json.dump({"env": environment(), "experts": E + N_SHARED, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
