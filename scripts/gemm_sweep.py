"""Offline tuning sweep for gemm_configs.TUNED_SM90 (run on the GPU; never on a serving path).

For each bench weight shape and token-count bucket, times candidate GemmConfigs of the W4A16 and
FP8 block GEMMs as CUDA-graph replays, checks each candidate's output against the default
config's, and prints the fastest per (kind, m_bucket, n, k) as a Python dict literal.
Usage: python scripts/gemm_sweep.py OUT.json [--quick]
"""
from __future__ import annotations

import json
import sys

import torch
import triton.testing as tt

from dsquant.formats.awq_gemm import to_awq_tensors
from dsquant.formats.fp8_block import quantize_fp8_block
from dsquant.formats.int_grid import quantize_int_groupwise
from dsquant.runtime.kernels.gemm.fp8_gemm import fp8_block_linear
from dsquant.runtime.kernels.gemm.gemm_configs import GemmConfig, m_bucket
from dsquant.runtime.kernels.gemm.w4a16_gemm import w4a16_linear
from dsquant.runtime.kernels.gemm.w4a16_repack import repack_awq

SHAPES = [(2048, 10944), (2048, 2816), (7168, 4096), (7168, 18432)]
DECODE_M = [1, 64]
PREFILL_M = [256, 1024, 4096]
SPLITS = [1, 2, 4, 8]


def decode_candidates(kind, m):
    bm = max(16, 1 << (m - 1).bit_length())
    paths = ["fused", "weight_only"] if kind == "fp8" else ["fused"]
    for path in paths:
        for bn, warps in ((64, 4), (128, 4), (128, 8), (256, 8)):
            for split in SPLITS:
                yield GemmConfig(bm, bn, split, warps, 4, path)


def prefill_candidates(kind):
    if kind == "w4a16":
        tiles = [(64, 128, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4), (64, 256, 8, 3)]
    else:
        tiles = [(64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 8, 4), (64, 256, 8, 3)]
    for bm, bn, warps, stages in tiles:  # register-spill-free on sm_90 (ptxas -v)
        yield GemmConfig(bm, bn, 1, warps, stages)
    if kind == "w4a16":
        yield GemmConfig(128, 128, 1, 8, 3, path="dequant")


def time_graph(fn, rep_ms=15):
    return tt.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3


def main(out_path: str) -> None:
    results, best = [], {}
    counters = torch.zeros(8192, dtype=torch.int32, device="cuda")
    for k, n in SHAPES:
        w = torch.randn(n, k, device="cuda") * 0.02
        q, s, z = quantize_int_groupwise(w, 128)
        int4 = repack_awq(*to_awq_tensors(q, s, z, dtype=torch.bfloat16), 128)
        wq, ws = quantize_fp8_block(w)
        for m in DECODE_M + PREFILL_M:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for kind in ("w4a16", "fp8"):
                if kind == "w4a16":
                    run = lambda cfg: w4a16_linear(x, int4, cfg)
                else:
                    run = lambda cfg: fp8_block_linear(x, wq, ws, config=cfg, splitk_counters=counters)
                ref = run(None).float()
                cands = decode_candidates(kind, m) if m <= 64 else prefill_candidates(kind)
                for cfg in cands:
                    try:
                        y = run(cfg).float()
                        err = ((y - ref).norm() / ref.norm()).item()
                        us = time_graph(lambda: run(cfg)) if err < 5e-2 else float("inf")
                    except Exception as e:  # out of shared memory or registers: not a candidate
                        err, us = None, float("inf")
                        print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:80]}")
                    results.append(dict(kind=kind, k=k, n=n, m=m, cfg=cfg.__dict__, us=us, err=err))
                    key = (kind, m_bucket(m), n, k)
                    if us < best.get(key, (float("inf"),))[0]:
                        best[key] = (us, cfg)
                print(f"{kind:6s} {k}x{n} M={m}: best {best.get((kind, m_bucket(m), n, k))}", flush=True)
        del w, int4, wq, ws
        torch.cuda.empty_cache()
        with open(out_path, "w") as f:  # after every shape, so a cut-short sweep still counts
            json.dump({"results": results, "best": [dict(key=list(kk), us=v[0], cfg=v[1].__dict__)
                                                    for kk, v in best.items()]}, f, indent=1)
    print("TUNED_SM90 = {")
    for kk, (us, c) in sorted(best.items()):
        print(f"    {kk!r}: GemmConfig({c.block_m}, {c.block_n}, {c.split_k}, {c.num_warps}, "
              f"{c.num_stages}, {c.path!r}),  # {us:.1f} us")
    print("}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gemm_sweep.json")
