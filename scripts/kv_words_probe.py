"""FP8-KV-cache decode with the tiles read as words (issue 23: decode at 32K >= 1.3x the bf16 cache), on the GPU.

    PYTHONPATH=. python scripts/kv_words_probe.py OUT.json [--budget-s 300] [--only gqa,mla16,mla128]

At B 32, L 32768 and 4096, block size 64, each a CUDA-graph median with the compiled kernel's registers and
spills (kvfp8_sweep.py's measuring): the bf16 cache at its defaults (and the configs that were its best), the
FP8 cache at today's defaults, and the words kernels (paged_decode_fp8.py, mla_decode_fp8_words.py) over a
grid of launch configs. GQA: Hq 32, Hkv 8, D 128. MLA: 16 and 128 heads, latent 512 + rope 64. Outputs are
checked against the bf16 cache's (the e4m3 rounding: a few 1e-2). Rows are written as they come.
"""
import argparse
import itertools
import json
import math
import os
import time

import torch
from kvfp8_sweep import KERNELS, _measure

from dsquant.bench.attention_common import RANK, ROPE, _paged_copy, _rel
from dsquant.bench.common import environment
from dsquant.runtime.kernels.attention.kv_fp8_layout import mla_fp8_token_bytes, quantize_fp8, quantize_mla_fp8
from dsquant.runtime.kernels.attention.mla_decode import MLADecodeConfig, mla_decode_attention
from dsquant.runtime.kernels.attention.mla_decode_fp8_words import mla_decode_fp8_words_kernel
from dsquant.runtime.kernels.attention.paged_decode import DecodeConfig, paged_decode_attention
from dsquant.runtime.kernels.attention.paged_decode_fp8 import paged_decode_fp8_words_kernel
from dsquant.runtime.kernels.attention.split_kv_merge import choose_num_splits, num_sms

BS = 64
KERNELS += [paged_decode_fp8_words_kernel, mla_decode_fp8_words_kernel]


def _gqa_configs(batch, hkv, length):
    def splits2(bn):
        return 2 * choose_num_splits(batch * hkv, length, 4 * bn, num_sms(torch.device("cuda")))
    rows = [("bf16", DecodeConfig()), ("bf16", DecodeConfig(num_splits=splits2(64))), ("fp8", DecodeConfig()),
            ("fp8", DecodeConfig(block_n=128, fp8_f16=True))]
    for bn, w, st, sp in itertools.product((64, 128), (4, 8), (2, 3), (False, True)):
        rows.append(("fp8", DecodeConfig(block_n=bn, num_warps=w, num_stages=st, num_splits=splits2(bn) if sp else 0,
                                         fp8_words=True)))
    return rows


def gqa_rows(length, rep_ms, gen, emit, deadline):
    batch, hq, hkv, dim = 32, 32, 8, 128
    q = torch.randn(batch, hq, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, length, hkv, dim, device="cuda", dtype=torch.bfloat16)
    k_cache, table = _paged_copy(k, BS, gen)
    del k
    v_cache = torch.randn_like(k_cache)
    (kq, ks), (vq, vs) = quantize_fp8(k_cache), quantize_fp8(v_cache)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    scale = 1.0 / math.sqrt(dim)
    ref = paged_decode_attention(q, k_cache, v_cache, table, lens, scale, max_seq_len=length)
    shape = f"gqa B={batch} Hq={hq} Hkv={hkv} L={length} D={dim} bs={BS}"
    bytes16, bytes8 = 4 * batch * length * hkv * dim, 2 * batch * length * hkv * (dim + 4)
    for kind, c in _gqa_configs(batch, hkv, length):
        if time.time() > deadline:
            return
        out = torch.full_like(q, float("nan"))
        if kind == "bf16":
            fn = lambda c=c: paged_decode_attention(q, k_cache, v_cache, table, lens, scale,  # noqa: E731
                                                    max_seq_len=length, config=c, out=out)
        else:
            fn = lambda c=c: paged_decode_attention(q, kq, vq, table, lens, scale, max_seq_len=length,  # noqa: E731
                                                    config=c, out=out, k_scale=ks, v_scale=vs)
        _emit(emit, shape, kind, c, fn, ref, bytes16 if kind == "bf16" else bytes8, rep_ms)


def _mla_configs(heads):
    if heads <= 16:
        rows = [("bf16", None), ("bf16", MLADecodeConfig(block_n=16)), ("fp8", None)]
        grid = itertools.product((0,), (16, 32, 64), (4, 8), (1, 2, 3))
    else:
        rows = [("bf16", None), ("fp8", None)]
        grid = itertools.product((32, 64), (16, 32), (8,), (1, 2))
    for bh, bn, w, st in grid:
        rows.append(("fp8", MLADecodeConfig(block_h=bh, block_n=bn, num_warps=w, num_stages=st, fp8_words=True)))
    lazy = ((0, 16, 4, 2), (0, 32, 4, 2)) if heads <= 16 else ((64, 16, 8, 1), (64, 16, 8, 2), (64, 32, 8, 2), (32, 32, 8, 2))
    for bh, bn, w, st in lazy:  # the rescale only in tiles that need it (MLADecodeConfig.lazy_rescale)
        rows.append(("fp8", MLADecodeConfig(block_h=bh, block_n=bn, num_warps=w, num_stages=st, fp8_words=True,
                                            lazy_rescale=True)))
    return rows


def mla_rows(heads, length, rep_ms, gen, emit, deadline):
    batch = 32
    latent = torch.randn(batch, length, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
    cache, table = _paged_copy(latent, BS, gen)
    del latent
    flat = cache.view(-1, RANK + ROPE)
    cache8 = quantize_mla_fp8(flat[:, :RANK], flat[:, RANK:], torch.bfloat16).view(*cache.shape[:2], -1)
    q_abs = torch.randn(batch, heads, RANK, device="cuda", dtype=torch.bfloat16) / math.sqrt(RANK)
    q_pe = torch.randn(batch, heads, ROPE, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    scale = 1.0 / math.sqrt(192)
    ref = mla_decode_attention(q_abs, q_pe, cache, table, lens, scale, max_seq_len=length)
    shape = f"mla H={heads} B={batch} L={length} bs={BS}"
    bytes16, bytes8 = batch * length * (RANK + ROPE) * 2, batch * length * mla_fp8_token_bytes(RANK, ROPE)
    for kind, c in _mla_configs(heads):
        if time.time() > deadline:
            return
        out = torch.full_like(q_abs, float("nan"))
        kv = cache if kind == "bf16" else cache8
        fn = lambda c=c, kv=kv: mla_decode_attention(q_abs, q_pe, kv, table, lens, scale,  # noqa: E731
                                                     max_seq_len=length, config=c, out=out)
        _emit(emit, shape, kind, c, fn, ref, bytes16 if kind == "bf16" else bytes8, rep_ms)


def _emit(emit, shape, kind, config, fn, ref, nbytes, rep_ms):
    name = "default" if config is None else str(config)
    try:
        res, us, regs = _measure(fn, rep_ms)
    except Exception as e:  # noqa: BLE001 - a config that does not compile is a row too
        emit({"shape": shape, "kind": kind, "config": name, "error": repr(e)[:300]})
        return
    emit({"shape": shape, "kind": kind, "config": name, "us": us, "GBps": nbytes / us / 1e3, "check": _rel(res, ref),
          "kernels": regs})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--rep-ms", type=int, default=30)
    ap.add_argument("--only", default="gqa,mla16,mla128")
    ap.add_argument("--lengths", default="32768,4096")
    args = ap.parse_args()
    deadline = time.time() + args.budget_s
    rows = []
    gen = torch.Generator().manual_seed(0)

    def emit(row):
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), row.get("kernels"), flush=True)
        with open(args.out + ".tmp", "w") as f:
            json.dump({"env": environment(), "rows": rows}, f, indent=1)

    torch.manual_seed(0)
    parts = args.only.split(",")
    for length in (int(x) for x in args.lengths.split(",")):
        if "gqa" in parts:
            gqa_rows(length, args.rep_ms, gen, emit, deadline)
        for heads in (16, 128):
            if f"mla{heads}" in parts:
                mla_rows(heads, length, args.rep_ms, gen, emit, deadline)
        torch.cuda.empty_cache()
    os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
