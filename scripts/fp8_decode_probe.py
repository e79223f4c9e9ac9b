"""H200 probe of the FP8 block decode GEMV at M = 1, 2 on the V2-Lite and bench shapes, weights read
from HBM (enough copies of each weight to overflow the 60 MB L2, cycled inside one CUDA graph).

    python scripts/fp8_decode_probe.py OUT.json [--m 1,2] [--copies-mb 256]

Per shape and M, graph-replay medians per call (us) of:
  bf16            cuBLAS on the dense bf16 weight (the peer)
  default         fp8_block_linear as the runtime calls it (fp8_config's path)
  gemv_fused      the FP8 GEMV quantizing x inside every program (A_MODE 1)
  quant           per_token_group_quant_fp8 alone (x -> e4m3 + scales, one launch)
  gemv_prequant   quant, then the GEMV on the quantized x (A_MODE 0): two launches
  cublas          torch._scaled_mm blockwise, with its activation quantization
  kblock_*        fp8_gemv_kblock.py (block_n, k_blocks, split): _on_quantized on the quantized x,
                  _prequant after the quant launch, _fused quantizing x inside (FUSE_QUANT)
each output checked against the W8A8 torch product (rel. err), and the bytes each call reads.
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
from dsquant.formats.fp8_block import quantize_fp8_block
from dsquant.runtime.kernels.gemm.fp8_gemm import fp8_block_linear
from dsquant.runtime.kernels.gemm.fp8_gemv import fp8_gemv
from dsquant.runtime.kernels.gemm.fp8_quant import per_token_group_quant_fp8
from dsquant.runtime.kernels.gemm.gemm_configs import GemmConfig, fp8_config, fp8_gemv_config

KBLOCK_CONFIGS = [(16, 4, 1), (16, 4, 2), (16, 8, 1), (32, 2, 2), (32, 4, 1), (16, 2, 4)]  # (block_n, k_blocks, split)
SHAPES = [(2048, 3648), (2048, 2048), (512, 4096), (2048, 21888), (10944, 2048),
          (7168, 18432), (7168, 4096), (2048, 10944), (2048, 2816)]  # (K, N)


def _w8a8_ref(x, wq, ws):
    """float32 W8A8 product: x quantized per 128-block as the kernels do, weights dequantized."""
    xq, xs = per_token_group_quant_fp8(x, 128)
    n, k = wq.shape
    xd = xq.float() * xs.repeat_interleave(128, 1)[:, :k]  # [M, K]
    wd = wq.float() * ws.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return xd @ wd.t()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--m", default="1,2")
    ap.add_argument("--copies-mb", type=float, default=256.0)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    counters = torch.zeros(8192, dtype=torch.int32, device="cuda")
    for k, n in SHAPES:
        # block scales over three orders of magnitude, a few outlier channels
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        w *= torch.logspace(-1.5, 1.5, -(-n // 128), device="cuda").repeat_interleave(128)[:n, None]
        w[:, :: max(1, k // 7)] *= 8.0
        wq, ws = quantize_fp8_block(w)
        copies = max(1, int(args.copies_mb * 2**20 // wq.numel()))
        wqs = [wq.clone() for _ in range(copies)]
        wb = w.to(torch.bfloat16)
        wbs = [wb.clone() for _ in range(max(1, int(args.copies_mb * 2**20 // (2 * wb.numel()))))]
        for m in map(int, args.m.split(",")):
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            ref = _w8a8_ref(x, wq, ws)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            g = fp8_gemv_config(m, n, k, x.device)
            xq, xs = per_token_group_quant_fp8(x, 128)
            forms = {
                "bf16": (lambda c: torch.matmul(x, c.t()), wbs),
                "default": (lambda c: fp8_block_linear(x, c, ws, out=out, splitk_counters=counters), wqs),
                "gemv_fused": (lambda c: fp8_gemv(x, None, c, ws, out, g.block_n, g.split_k, g.num_warps, 1, counters), wqs),
                "quant": (lambda c: per_token_group_quant_fp8(x, 128), wqs[:1] * len(wqs)),
                "gemv_prequant": (lambda c: fp8_gemv(*per_token_group_quant_fp8(x, 128), c, ws, out, g.block_n,
                                                     g.split_k, g.num_warps, 1, counters), wqs),
                "gemv_on_quantized": (lambda c: fp8_gemv(xq, xs, c, ws, out, g.block_n, g.split_k, g.num_warps, 1,
                                                         counters), wqs),
                "cublas": (lambda c: fp8_block_linear(x, c, ws, out=out, config=GemmConfig(m, 128, 1, 4, 1, path="cublas")),
                           wqs),
            }
            if k % 128 == 0:  # the K-block GEMV (fp8_gemv_kblock.py) on x quantized once, a few configs
                for bn, kb, split in KBLOCK_CONFIGS:
                    cfg = GemmConfig(m, bn, split, 4, 1, path="gemv_kblock", k_chunks=kb)
                    forms[f"kblock_{bn}_{kb}_{split}_on_quantized"] = (
                        lambda c, cfg=cfg: fp8_block_linear(xq, c, ws, x_scale=xs, config=cfg, out=out,
                                                            splitk_counters=counters), wqs)
                    forms[f"kblock_{bn}_{kb}_{split}_prequant"] = (
                        lambda c, cfg=cfg: fp8_block_linear(x, c, ws, config=cfg, fuse_quant=False, out=out,
                                                            splitk_counters=counters), wqs)
                    forms[f"kblock_{bn}_{kb}_{split}_fused"] = (
                        lambda c, cfg=cfg: fp8_block_linear(x, c, ws, config=cfg, fuse_quant=True, out=out,
                                                            splitk_counters=counters), wqs)
            r = dict(k=k, n=n, m=m, copies=copies, fp8_bytes=wq.numel() + ws.numel() * 4,
                     default_path=fp8_config(m, n, k, x.device).path)
            for name, (fn, ws_list) in forms.items():
                try:
                    y = fn(ws_list[0])
                    if name not in ("quant", "bf16"):
                        r[f"{name}_err"] = float((y.float() - ref).norm() / ref.norm())
                    us = tt.do_bench_cudagraph(lambda: [fn(c) for c in ws_list], rep=30,
                                               return_mode="median") * 1e3 / len(ws_list)
                except Exception as e:  # noqa: BLE001 - a form that fails is reported, not fatal
                    us = None
                    r[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:120]}"
                r[f"{name}_us"] = us
            rows.append(r)
            print(json.dumps(r), flush=True)
        del wqs, wbs, w, wb
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"env": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
