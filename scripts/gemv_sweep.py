"""Offline sweep of the decode GEMV launch configs (W4A16, and FP8 when fp8_gemv exists), on the GPU.

For each bench weight shape and M in {1, 2, 4}: times cuBLAS bf16, torch's tinygemm and the
tiled W4A16 decode kernel as peers, then every GEMV candidate (block_n x warps x split-K), all as
CUDA-graph replay medians on the same inputs; checks each candidate's output against an fp32
product with the dequantized weight; writes every timing and the best config per (kind, n, k, m)
to OUT.json. FP8 block (--fp8): peers bf16 and the tiled FP8 kernel; candidates
gemm_configs.fp8_gemv_candidates, checked against the W8A8 tiled kernel's output.
W4A16 weights are in the kernel layout's paired code order (int4_paired.py) (what the loader builds for K % 128 ==
0), so the candidates run the sliced GEMV; --plain also times the plain-order GEMV's candidates on
the same codes (kind "w4a16plain_gemv"), --v2lite adds V2-Lite's attention / dense-MLP shapes
(2048 x 3648 fused q + kv_a, 2048 x 2048 o_proj, 512 x 4096 kv_b, 2048 x 21888 dense gate_up), and
--m 1,2 picks the token counts, --kblock adds the K-block GEMV's candidates (w4a16_gemv_kblock.py) and
--no-gemv drops the one-chunk GEMV's; --cold MB times every W4A16 form over enough copies of the
weights (bf16 size) to fill MB megabytes, cycled in one graph, so the weights come from HBM, not L2.
Usage: python scripts/gemv_sweep.py OUT.json [--quick] [--fp8] [--no-w4a16] [--plain] [--v2lite] [--m 1,2]
       [--kblock] [--no-gemv] [--cold 256]
"""
from __future__ import annotations

import json
import sys
import time

import torch
import triton.testing as tt

from dsquant.bench.gemm import _tinygemm_pack
from dsquant.formats.awq_gemm import to_awq_tensors
from dsquant.formats.fp8_block import quantize_fp8_block
from dsquant.formats.int_grid import quantize_int_groupwise
from dsquant.runtime.kernels.gemm.fp8_gemm import fp8_block_linear
from dsquant.runtime.kernels.gemm.gemm_configs import GemmConfig, fp8_gemv_candidates, fp8_tiled_config, w4a16_config
from dsquant.runtime.kernels.gemm.w4a16_gemm import w4a16_linear
from dsquant.runtime.kernels.gemm.w4a16_gemv import w4a16_gemv
from dsquant.formats.gptq import pack_gptq_qweight
from dsquant.runtime.kernels.gemm.w4a16_repack import W4A16Weights, codes_nk, dequantize_w4a16, repack_awq

SHAPES = [(7168, 18432), (7168, 4096), (2048, 10944), (2048, 2816)]
V2LITE_SHAPES = [(2048, 3648), (2048, 2048), (512, 4096), (2048, 21888)]
M_VALUES = [1, 2, 4]


def plain_copy(w: W4A16Weights) -> W4A16Weights:
    """The same codes, scales and zeros in the plain code order (nibble i of word c holds k = 8c + i)."""
    qweight = pack_gptq_qweight(codes_nk(w).t().contiguous()).t().contiguous()  # [N, K/8]
    return W4A16Weights(qweight=qweight, scales=w.scales, zeros=w.zeros, group_size=w.group_size, perm=w.perm,
                        splitk_counters=torch.zeros_like(w.splitk_counters), sliced=False)


_CALLS = [1]  # calls one timed fn makes (--cold cycles weight copies inside the fn)


def time_graph(fn, rep_ms=10) -> float:
    return tt.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3 / _CALLS[0]


def _int4_clone(w: W4A16Weights) -> W4A16Weights:
    return W4A16Weights(qweight=w.qweight.clone(), scales=w.scales.clone(), zeros=w.zeros.clone(),
                        group_size=w.group_size, perm=w.perm, splitk_counters=torch.zeros_like(w.splitk_counters),
                        sliced=w.sliced)


def candidates(m: int, quick: bool):
    bm = 1 << (m - 1).bit_length()
    blocks = (32, 64, 128) if not quick else (32, 64)
    for bn in blocks:
        for warps in ((2, 4, 8) if not quick else (2, 4)):
            for split in (1, 2, 4, 8, 16):
                yield GemmConfig(bm, bn, split, warps, 1, path="gemv")


def kblock_candidates(m: int, k: int):
    """The K-block GEMV (w4a16_gemv_kblock.py, sliced weights, M <= 2): block_n x k_chunks x warps x split-K."""
    chunks = k // 128
    for bn in (16, 32):
        for kc in (4, 8, 16):
            for warps in (2, 4):
                for split in (1, 2, 4, 8):
                    if split == 1 or split <= -(-chunks // kc):
                        yield GemmConfig(m, bn, split, warps, 1, path="gemv_kblock", k_chunks=kc)


def rel_err(y, ref) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def time_peers(peers: dict, rows, k, n, m, label: str = "") -> None:
    """Times each peer fn; one that fails is reported (us None), not fatal."""
    for name, fn in peers.items():
        try:
            us = time_graph(fn)
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
            print(f"  {name} failed: {type(e).__name__}: {str(e)[:100]}")
            us = None
        rows.append(dict(kind="peer", name=name, k=k, n=n, m=m, us=us))
        print(f"{label}{k}x{n} M={m} {name}: {us}", flush=True)


def time_candidates(kind: str, cands, run, ref, tol: float, rows, best, k, n, m) -> str:
    """Checks each config's output against ref (rel. err < tol) and times it; returns best's key."""
    key = f"{kind.split('_')[0]} {n} {k} {m}"
    for cfg in cands:
        try:
            err = rel_err(run(cfg), ref)
            us = time_graph(lambda: run(cfg)) if err < tol else float("inf")
        except Exception as e:  # noqa: BLE001 - does not compile or fit: not a candidate
            err, us = None, float("inf")
            print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:80]}")
        rows.append(dict(kind=kind, k=k, n=n, m=m, cfg=cfg.__dict__, us=us, err=err))
        if us < best.get(key, {"us": float("inf")})["us"]:
            best[key] = dict(us=us, cfg=cfg.__dict__, err=err)
    return key


def sweep_fp8(rows, best, t0) -> None:
    counters = torch.zeros(8192, dtype=torch.int32, device="cuda")
    for k, n in SHAPES:
        w = torch.randn(n, k, device="cuda") * 0.02
        wq, ws = quantize_fp8_block(w)
        wb = w.to(torch.bfloat16)
        for m in M_VALUES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            tiled = fp8_tiled_config(m, n, k, x.device)
            run = lambda cfg: fp8_block_linear(x, wq, ws, config=cfg, splitk_counters=counters)  # noqa: E731
            ref = run(tiled).float()
            time_peers({"bf16": lambda: torch.matmul(x, wb.t()), "fp8_tiled": lambda: run(tiled),
                        "fp8_default": lambda: run(None)}, rows, k, n, m, "fp8 ")
            time_candidates("fp8_gemv", fp8_gemv_candidates(m), run, ref, 1e-2, rows, best, k, n, m)
            print(f"  best fp8 gemv {best.get(f'fp8 {n} {k} {m}')}  [{time.time() - t0:.0f} s]", flush=True)


def main(out_path: str, quick: bool, fp8: bool, w4a16: bool, plain: bool = False,
         shapes=SHAPES, m_values=M_VALUES, kblock: bool = False, gemv: bool = True, cold_mb: float = 0.0) -> None:
    rows, best = [], {}
    t0 = time.time()
    if fp8:
        sweep_fp8(rows, best, t0)
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "best": best}, f, indent=1)
    for k, n in (shapes if w4a16 else []):
        w = torch.randn(n, k, device="cuda") * 0.02
        q, s, z = quantize_int_groupwise(w, 128)
        int4 = repack_awq(*to_awq_tensors(q, s, z, dtype=torch.bfloat16), 128)
        dense = dequantize_w4a16(int4, torch.float32)  # [N, K]
        wb = w.to(torch.bfloat16)
        tg = _tinygemm_pack(q, s.float(), z, 128)
        int4_plain = plain_copy(int4) if plain else None
        copies = max(1, int(cold_mb * 2**20 // wb.numel() // 2)) if cold_mb else 1  # bf16 bytes > the L2
        i4s = [int4] + [_int4_clone(int4) for _ in range(copies - 1)]
        wbs = [wb] + [wb.clone() for _ in range(copies - 1)]
        tgs = [tg] + [tuple(t.clone() for t in tg) for _ in range(copies - 1)]
        i4p = [int4_plain] + [plain_copy(w_) for w_ in i4s[1:]] if plain else None
        _CALLS[0] = copies
        for m in m_values:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ dense.t()

            def on_all(f, ws):  # f on every copy; the first copy's output
                return [f(w_) for w_ in ws][0]
            peers = {"bf16": lambda: on_all(lambda w_: torch.matmul(x, w_.t()), wbs),
                     "tinygemm": lambda: on_all(lambda t_: torch.ops.aten._weight_int4pack_mm(x, t_[0], 128, t_[1]), tgs),
                     "w4a16_tiled": lambda: on_all(lambda w_: w4a16_linear(x, w_, GemmConfig(16, 64, 8, 4, 4)), i4s),
                     "w4a16_default": lambda: on_all(lambda w_: w4a16_linear(x, w_), i4s)}
            dflt = w4a16_config(m, n, k, 128, x.device, sliced=True)
            if dflt.path == "gemv":  # the default GEMV with the nibble's AND and OR as two LOP3s
                out2 = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                peers["w4a16_gemv_two_lop3"] = lambda: on_all(lambda w_: w4a16_gemv(
                    x, w_, out2, dflt.block_n, dflt.split_k, dflt.num_warps, asm=False), i4s)
            time_peers(peers, rows, k, n, m)
            print(f"  default config: {dflt}")
            time_candidates("w4a16_gemv", candidates(m, quick) if gemv else [],
                            lambda cfg: on_all(lambda w_: w4a16_linear(x, w_, cfg), i4s), ref, 2e-2, rows, best, k, n, m)
            print(f"  best gemv {best.get(f'w4a16 {n} {k} {m}')}  [{time.time() - t0:.0f} s]", flush=True)
            if kblock and m <= 2:
                time_candidates("w4a16kblock_gemv", kblock_candidates(m, k),
                                lambda cfg: on_all(lambda w_: w4a16_linear(x, w_, cfg), i4s), ref, 2e-2, rows, best, k, n, m)
                print(f"  best kblock gemv {best.get(f'w4a16kblock {n} {k} {m}')}", flush=True)
            if plain:
                time_candidates("w4a16plain_gemv", candidates(m, quick),
                                lambda cfg: on_all(lambda w_: w4a16_linear(x, w_, cfg), i4p), ref, 2e-2, rows, best, k, n, m)
                print(f"  best plain gemv {best.get(f'w4a16plain {n} {k} {m}')}", flush=True)
            with open(out_path, "w") as f:  # after every M, so a cut-short sweep still counts
                json.dump({"rows": rows, "best": best}, f, indent=1)
        del w, int4, int4_plain, dense, wb, tg, i4s, wbs, tgs, i4p
        _CALLS[0] = 1
        torch.cuda.empty_cache()


if __name__ == "__main__":
    argv = sys.argv
    ms = [int(v) for v in argv[argv.index("--m") + 1].split(",")] if "--m" in argv else M_VALUES
    main(argv[1] if len(argv) > 1 else "gemv_sweep.json", "--quick" in argv, "--fp8" in argv,
         "--no-w4a16" not in argv, "--plain" in argv, SHAPES + (V2LITE_SHAPES if "--v2lite" in argv else []), ms,
         "--kblock" in argv, "--no-gemv" not in argv, float(argv[argv.index("--cold") + 1]) if "--cold" in argv else 0.0)
