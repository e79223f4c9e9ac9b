"""H200 probe of what limits the INT4 per-pair MoE GEMV (moe_gemv.py) at decode, V2-Lite layer.

    python scripts/moe_gemv_probe.py OUT.json [--tokens 1,2] [--layers 8] [--kernels gemv,pair]

For each token count and GEMV config (block_n, warps, split_k), each projection (gate/up, down) timed
as CUDA-graph replays over `--layers` weight copies (read from HBM, not L2), in two forms:
  full        moe_gemv_int4 as fused_moe runs it (checked against the dequantized float32 product)
  loads_only  the same launch with LOADS_ONLY: the same weight loads, each word added once, no
              dequantization, no activation / scale / zero loads
and the bytes of the experts the pairs read (codes + scales + zeros) over each time, against the 4.25
TB/s roofline. full - loads_only is what the dequantization and dot cost; loads_only against the
roofline is what the launch shape and load pattern cost. full_two_lop3: the full kernel with the
nibble's AND and OR as plain Triton ops (two LOP3s a code) instead of one inline lop3.
--kernels pair (or gemv,pair) adds the tensor-core form with split-K (moe_pair_mma.py) over
PAIR_CONFIGS, form "full" only, and --gemv-default keeps only the GEMV config fused_moe runs;
--kernels grouped adds the grouped GEMM at fused_moe's config (pick_configs; one block per pair up to
ONE_BLOCK_PER_PAIR_MAX_TOKENS tokens, else moe_align, which is built outside the timed region: the
engine builds it once per layer for both projections), the path beyond MOE_GEMV_MAX_PAIRS pairs.
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
from dsquant.runtime.kernels.moe.int4_dequant import dequantize_int4_grouped
from dsquant.runtime.kernels.moe.moe_gemv import default_split_k, effective_split, moe_gemv_int4
from dsquant.runtime.kernels.moe.fused_moe import ONE_BLOCK_PER_PAIR_MAX_TOKENS, pick_configs
from dsquant.runtime.kernels.moe.moe_align import moe_align_block_size, one_block_per_pair
from dsquant.runtime.kernels.moe.moe_gemm import moe_gemm
from dsquant.runtime.kernels.moe.moe_pair_mma import moe_pair_mma_int4

# (block_n, num_warps, split_k or None for the rule) of the pair MMA
PAIR_CONFIGS = [(32, 1, None), (32, 2, None), (64, 2, None), (64, 2, 4), (64, 4, None), (64, 4, 8), (128, 4, None),
                (128, 4, 8)]
CONFIGS = [(8, 1, 1), (8, 1, None), (16, 1, None), (16, 1, 1), (16, 1, 4), (32, 1, None), (32, 2, None), (64, 4, None)]


def projection_bytes(g, experts) -> int:
    """Bytes of one projection's tensors for the given experts."""
    return sum(t[0].numel() * t.element_size() * len(experts) for t in (g.weight, g.scales, g.zeros))


def _rel_err(run, a, ids, out, tw, dense, gated, pairs, n_out, dev) -> float:
    """||out after run() - float32 product of the dequantized experts|| / ||that product|| on one layer."""
    run()
    rows_a = a.float()[torch.arange(pairs, device=dev) // (TOP_K + N_SHARED)] if gated else a.float()
    y = torch.einsum("pk,pnk->pn", rows_a, dense[ids.reshape(-1)])  # [P, N]
    ref = (torch.nn.functional.silu(y[:, :n_out]) * y[:, n_out:]) if gated else y * tw.reshape(-1, 1).float()
    return float((out.float() - ref).norm() / ref.norm())


def _grouped_row(calls, t, pairs, gated, n_out, dense, nbytes, dev) -> dict:
    """The grouped GEMM as fused_moe runs it past the decode rule (see the module docstring)."""
    div = TOP_K + N_SHARED if gated else 1
    cfg = pick_configs(pairs, E + N_SHARED, "int4")[0 if gated else 1]
    aligns = [one_block_per_pair(ids, cfg.block_m) if t <= ONE_BLOCK_PER_PAIR_MAX_TOKENS
              else moe_align_block_size(ids, E + N_SHARED, cfg.block_m) for _, _, ids, _, _ in calls]

    def run():
        for (a_, g_, ids_, out_, tw_), align in zip(calls, aligns):
            moe_gemm(a_, g_, align, out_, cfg, div, gated, None if gated else tw_)
    a, g, ids, out, tw = calls[0]
    r = dict(kernel="grouped", tokens=t, projection="gate_up" if gated else "down", block_n=cfg.block_n,
             warps=cfg.num_warps, split_k=1, bytes=nbytes,
             rel_err=_rel_err(lambda: moe_gemm(a, g, aligns[0], out, cfg, div, gated, None if gated else tw),
                              a, ids, out, tw, dense, gated, pairs, n_out, dev))
    us = tt.do_bench_cudagraph(run, rep=50, return_mode="median") * 1e3 / len(calls)
    r["full_us"], r["full_roofline"] = us, nbytes / us / 1e3 / ROOFLINE_GBS
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tokens", default="1,2")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kernels", default="gemv", help="a comma list of gemv, pair, grouped")
    ap.add_argument("--gemv-default", action="store_true", help="only the GEMV config fused_moe runs (16, 1, rule)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script under TRITON_INTERPRET")
    args = ap.parse_args()
    dev, gen = args.device, torch.Generator(device=args.device).manual_seed(0)
    weights = [build_layer("int4", _random_dense(dev, gen), dev) for _ in range(args.layers)]
    rows = []
    for t in map(int, args.tokens.split(",")):
        routing = [_routing(t, dev, gen)[3] for _ in range(args.layers)]  # (topk_weights, ids) with shared
        pairs = t * (TOP_K + N_SHARED)
        for gated in (True, False):
            n_out, k = (I, H) if gated else (H, I)
            calls = []
            for w, (tw, ids) in zip(weights, routing):
                g = w.w13 if gated else w.w2
                a = torch.randn(t if gated else pairs, k, device=dev, generator=gen).to(torch.bfloat16)
                out = torch.full((pairs, n_out), float("nan"), device=dev, dtype=torch.bfloat16)
                calls.append((a, g, ids.contiguous(), out, tw))
            nbytes = sum(projection_bytes(g, torch.unique(ids).tolist()) for _, g, ids, _, _ in calls) / len(calls)
            # correctness of the full form on the first layer (float32 product of the dequantized experts)
            a, g, ids, out, tw = calls[0]
            dense = dequantize_int4_grouped(g, torch.float32).weight  # [E, N, K]
            kinds = args.kernels.split(",")
            gemv_configs = [(16, 1, None)] if args.gemv_default else CONFIGS
            for block_n, warps, split in (PAIR_CONFIGS if "pair" in kinds else []):
                r = dict(kernel="pair_mma", tokens=t, projection="gate_up" if gated else "down", block_n=block_n,
                         warps=warps, split_k=effective_split(split, k // 128) if split else
                         default_split_k(pairs, n_out, k, block_n), bytes=nbytes)
                r["rel_err"] = _rel_err(lambda: moe_pair_mma_int4(a, g, ids, out, TOP_K + N_SHARED if gated else 1, gated,
                                                        None if gated else tw, block_n, warps, split),
                                        a, ids, out, tw, dense, gated, pairs, n_out, dev)

                def run_pair():
                    for a_, g_, ids_, out_, tw_ in calls:
                        moe_pair_mma_int4(a_, g_, ids_, out_, TOP_K + N_SHARED if gated else 1, gated,
                                          None if gated else tw_, block_n, warps, split)
                us = tt.do_bench_cudagraph(run_pair, rep=50, return_mode="median") * 1e3 / len(calls)
                r["full_us"], r["full_roofline"] = us, nbytes / us / 1e3 / ROOFLINE_GBS
                rows.append(r)
                print(json.dumps(r), flush=True)
            if "grouped" in kinds:
                rows.append(_grouped_row(calls, t, pairs, gated, n_out, dense, nbytes, dev))
                print(json.dumps(rows[-1]), flush=True)
            for block_n, warps, split in (gemv_configs if "gemv" in kinds else []):
                r = dict(kernel="gemv", tokens=t, projection="gate_up" if gated else "down", block_n=block_n, warps=warps,
                         split_k=effective_split(split, k // 128) if split else default_split_k(pairs, n_out, k, block_n),
                         bytes=nbytes)
                r["rel_err"] = _rel_err(lambda: moe_gemv_int4(a, g, ids, out, TOP_K + N_SHARED if gated else 1, gated,
                                                        None if gated else tw, block_n, warps, split),
                                        a, ids, out, tw, dense, gated, pairs, n_out, dev)
                for form, loads_only, asm in (("full", False, None), ("loads_only", True, None),
                                              ("full_two_lop3", False, False)):
                    def run(loads_only=loads_only, asm=asm):
                        for a_, g_, ids_, out_, tw_ in calls:
                            moe_gemv_int4(a_, g_, ids_, out_, TOP_K + N_SHARED if gated else 1, gated,
                                          None if gated else tw_, block_n, warps, split, _loads_only=loads_only,
                                          _asm=asm)
                    us = tt.do_bench_cudagraph(run, rep=50, return_mode="median") * 1e3 / len(calls)
                    r[f"{form}_us"] = us
                    r[f"{form}_roofline"] = nbytes / us / 1e3 / ROOFLINE_GBS
                rows.append(r)
                print(json.dumps(r), flush=True)
    with open(args.out, "w") as f:
        json.dump({"env": environment(), "experts": E + N_SHARED, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
