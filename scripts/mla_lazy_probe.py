"""MLA decode with and without lazy rescaling (online_softmax.rescale_lazily), on the GPU (issue 23 item 2).

    PYTHONPATH=. python scripts/mla_lazy_probe.py OUT.json

bench attention's MLA decode shapes (bf16 cache, block size 64, pages scattered at random; 16 and 128 heads,
B 1 / 32 / 64, L 4096 / 32768): the default config (mla_decode.default_config, splits by heuristic)
against the same config with lazy_rescale=True, and at 128 heads also block_n 32 with it, in the same
process on the same inputs. CUDA-graph medians, latent read in GB/s, and each variant's relative
error against the float32 reference on one row. One JSON row per shape.
"""
import dataclasses
import json
import math
import sys

import torch
import triton.testing as tt

from dsquant.bench.attention_common import RANK, ROPE, _paged_copy
from dsquant.runtime.kernels.attention.mla_decode import default_config, mla_decode_attention
from dsquant.runtime.kernels.attention.reference_attention import mla_decode_reference


def _us(fn) -> float:
    return tt.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def row(heads, batch, length, gen):
    dev, dt = "cuda", torch.bfloat16
    latent = torch.randn(batch, length, RANK + ROPE, device=dev, dtype=dt)
    cache, table = _paged_copy(latent, 64, gen)
    del latent
    q_abs = torch.randn(batch, heads, RANK, device=dev, dtype=dt) / math.sqrt(RANK) * 4
    q_pe = torch.randn(batch, heads, ROPE, device=dev, dtype=dt)
    lens = torch.full((batch,), length, dtype=torch.int32, device=dev)
    scale = 1.0 / math.sqrt(128 + ROPE)
    out = torch.empty_like(q_abs)
    base = default_config(cache, heads)
    variants = {"default": base, "lazy": dataclasses.replace(base, lazy_rescale=True)}
    if heads > 16:
        variants["lazy_n32"] = dataclasses.replace(base, block_n=32, lazy_rescale=True)
    ref = mla_decode_reference(q_abs[:1], q_pe[:1], cache, table[:1], lens[:1], scale)  # one row, float32
    rec = {"shape": f"H={heads} B={batch} L={length} bs=64", "config": str(base)}
    for name, cfg in variants.items():
        def run(cfg=cfg):
            return mla_decode_attention(q_abs, q_pe, cache, table, lens, scale, max_seq_len=length, config=cfg,
                                        out=out)

        out.fill_(float("nan"))
        run()
        rec[f"{name}_err"] = float((out[:1].float() - ref).norm() / ref.norm())
        rec[f"{name}_us"] = _us(run)
        rec[f"{name}_gbs"] = batch * length * (RANK + ROPE) * 2 / rec[f"{name}_us"] / 1e3
    rec["lazy_speedup"] = rec["default_us"] / rec["lazy_us"]
    return rec


def main(path):
    gen = torch.Generator().manual_seed(0)
    rows = []
    for heads in (16, 128):
        for batch, length in ((1, 32768), (32, 4096), (32, 32768), (64, 4096), (64, 32768)):
            rows.append(row(heads, batch, length, gen))
            print(rows[-1], flush=True)
            with open(path, "w") as f:
                json.dump(rows, f, indent=1)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
