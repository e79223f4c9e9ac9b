"""GPU probe: the K-block INT4 expert GEMV (moe_gemv_kblock.py) against the per-pair GEMV fused_moe runs.

    python scripts/moe_gemv_kblock_probe.py OUT.json [--tokens 1,2] [--layers 8] [--quick] [--device cpu]

V2-Lite layer (64 routed + 2 shared experts, H 2048, I 1408, top-6 + 2 shared), `--layers` weight copies
cycled inside one CUDA graph so the weights come from HBM. For each token count and projection (gate/up,
down): moe_gemv_int4 as fused_moe._expert_gemvs launches it (block_n 16, 1 warp, default split) and every
K-block config of CONFIGS, each checked against the dequantized float32 product, timed as graph-replay
medians (µs per layer), with the bytes its experts hold over that time against the roofline.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton.testing as tt

from dsquant.bench.common import environment
from dsquant.bench.moe import H, I, N_SHARED, ROOFLINE_GBS, TOP_K, _random_dense, _routing, build_layer
from dsquant.runtime.kernels.moe.int4_dequant import dequantize_int4_grouped
from dsquant.runtime.kernels.moe.moe_gemv import moe_gemv_int4
from dsquant.runtime.kernels.moe.moe_gemv_kblock import moe_gemv_int4_kblock

# (block_n, k_chunks, num_warps, split_k)
CONFIGS = [(bn, kc, w, s) for (bn, kc), w, s in itertools.product(
    [(16, 16), (16, 8), (16, 4), (32, 16), (32, 8), (8, 16)], [2, 4, 8], [1, 2])]
QUICK = [(bn, kc, w, 1) for (bn, kc), w in itertools.product([(16, 16), (16, 8), (32, 16), (8, 16)], [2, 4, 8])] + \
    [(16, 8, 4, 2), (16, 4, 4, 2)]


def projection_bytes(g, experts) -> int:
    return sum(t[0].numel() * t.element_size() * len(experts) for t in (g.weight, g.scales, g.zeros))


def best_kblock(path: str, margin: float = 0.02) -> dict[str, tuple]:
    """{projection: (block_n, k_chunks, num_warps, split_k)} from a probe's JSON: per projection the
    K-block config fastest at one token among those no slower than the GEMV (by `margin`) at every
    token count probed, where it beats the GEMV at one token by `margin`; fused_moe.GEMV_KBLOCK's form."""
    rows = json.load(open(path))["rows"]
    best = {}
    for proj in ("gate_up", "down"):
        gemv = {r["tokens"]: r["us"] for r in rows if r["projection"] == proj and r["kernel"] == "gemv"}
        by_cfg: dict[tuple, dict[int, float]] = {}
        for r in rows:
            if r["projection"] == proj and r["kernel"] == "kblock" and r["rel_err"] < 2e-2:
                by_cfg.setdefault(tuple(r["config"]), {})[r["tokens"]] = r["us"]
        ok = [(us[1], cfg) for cfg, us in by_cfg.items() if 1 in us and set(us) == set(gemv)
              and all(us[t] <= gemv[t] * (1 + margin) for t in us)]
        if ok and 1 in gemv and min(ok)[0] < gemv[1] * (1 - margin):
            best[proj] = min(ok)[1]
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", default="1,2")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run under TRITON_INTERPRET (two configs)")
    ap.add_argument("--quick", action="store_true", help="QUICK's 14 configs instead of CONFIGS' 36")
    args = ap.parse_args()
    dev, gen = args.device, torch.Generator(device=args.device).manual_seed(0)
    configs = (QUICK if args.quick else CONFIGS) if dev == "cuda" else CONFIGS[:2]
    weights = [build_layer("int4", _random_dense(dev, gen), dev) for _ in range(args.layers)]
    bench = (lambda fn: tt.do_bench_cudagraph(fn, rep=50, return_mode="median")) if dev == "cuda" else \
        (lambda fn: fn() and 0.0)
    rows = []
    for t in map(int, args.tokens.split(",")):
        routing = [_routing(t, dev, gen)[3] for _ in range(args.layers)]  # (topk_weights, ids) with shared
        pairs = t * (TOP_K + N_SHARED)
        for gated in (True, False):
            n_out, k = (I, H) if gated else (H, I)
            div = TOP_K + N_SHARED if gated else 1
            calls = []
            for w, (tw, ids) in zip(weights, routing):
                a = torch.randn(t if gated else pairs, k, device=dev, generator=gen).to(torch.bfloat16)
                out = torch.full((pairs, n_out), float("nan"), device=dev, dtype=torch.bfloat16)
                calls.append((a, w.w13 if gated else w.w2, ids.contiguous(), out, tw))
            nbytes = sum(projection_bytes(g, torch.unique(ids).tolist()) for _, g, ids, _, _ in calls) / len(calls)
            a, g, ids, out, tw = calls[0]
            dense = dequantize_int4_grouped(g, torch.float32).weight  # [E, N, K]
            rows_a = a.float()[torch.arange(pairs, device=dev) // div] if gated else a.float()
            y = torch.einsum("pk,pnk->pn", rows_a, dense[ids.reshape(-1)])  # [P, N]
            ref = torch.nn.functional.silu(y[:, :n_out]) * y[:, n_out:] if gated else y * tw.reshape(-1, 1).float()

            def launch(kernel, cfg, a_, g_, ids_, out_, tw_):
                routed = None if gated else tw_
                if kernel == "gemv":
                    moe_gemv_int4(a_, g_, ids_, out_, div, gated, routed, block_n=16, num_warps=1)
                else:
                    bn, kc, warps, split = cfg
                    moe_gemv_int4_kblock(a_, g_, ids_, out_, div, gated, routed, block_n=bn, k_chunks=kc,
                                         num_warps=warps, split_k=split)

            for kernel, cfg in [("gemv", None)] + [("kblock", c) for c in configs]:
                out.fill_(float("nan"))
                launch(kernel, cfg, a, g, ids, out, tw)
                err = float((out.float() - ref).norm() / ref.norm())
                us = bench(lambda: [launch(kernel, cfg, *c) for c in calls]) * 1e3 / len(calls)
                r = dict(tokens=t, projection="gate_up" if gated else "down", kernel=kernel, config=cfg,
                         us=us, rel_err=err, roofline=nbytes / us / 1e3 / ROOFLINE_GBS if us else None)
                rows.append(r)
                print(json.dumps(r), flush=True)
            with open(args.out, "w") as f:  # after each projection: a timed-out run keeps what it measured
                json.dump({"env": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
