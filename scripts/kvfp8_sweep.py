"""FP8-KV-cache decode sweep on the GPU (issue 23: decode at 32K context >= 1.3x the bf16 cache).

    PYTHONPATH=. python scripts/kvfp8_sweep.py OUT.json [--budget-s 300]

For the GQA decode kernel (B 32, Hq 32, Hkv 8, D 128) and the MLA decode kernel (16 and 128 heads,
B 32, latent 512 + rope 64), at L 4096 and 32768, block size 64: every launch config of a small grid
for the bf16 cache and for the FP8 cache (bf16 dots, fp16 dots, and for MLA the scale-folding
kernel and the prefetching one, mla_decode_fp8_prefetch.py), each a CUDA-graph median, with the compiled kernel's registers and spills. The FP8 rows'
outputs are checked against the bf16 cache's (the e4m3 rounding: a few 1e-2). Rows are written as
they come, so a run cut short by its budget still leaves every row it measured.
"""
import argparse
import itertools
import json
import math
import os
import time
from types import SimpleNamespace

import torch
import triton.testing as tt

from dsquant.bench.attention_common import RANK, ROPE, _paged_copy, _rel
from dsquant.bench.common import environment
from dsquant.runtime.kernels.attention import mla_decode, mla_decode_fp8, paged_decode
from dsquant.runtime.kernels.attention.kv_fp8_layout import mla_fp8_token_bytes, quantize_fp8, quantize_mla_fp8
from dsquant.runtime.kernels.attention.mla_decode import MLADecodeConfig, mla_decode_attention
from dsquant.runtime.kernels.attention.paged_decode import DecodeConfig, paged_decode_attention

BS = 64
# bf16 cache; FP8 dequantizing kernel (bf16 / fp16 dots), scale-folding kernel, prefetching kernel (bf16 / fp16)
MLA_KINDS = ["bf16", "fp8", "fp8_f16", "fp8_folded", "fp8_prefetch", "fp8_prefetch_f16"]
KERNELS = [paged_decode._paged_decode_gqa_kernel, mla_decode._mla_decode_kernel, mla_decode_fp8.mla_decode_fp8_kernel]


def _compiled():
    """{id: compiled kernel} over every Triton cache of the decode kernels."""
    found = {}
    for fn in KERNELS:
        for entry in getattr(fn, "device_caches", {}).values():
            caches = entry[0] if isinstance(entry, tuple) else entry
            for k in caches.values():
                found[id(k)] = k
    return found


def _regs(before: dict) -> list:
    out = []
    for key, k in _compiled().items():
        if key in before:
            continue
        try:
            k._init_handles()
        except Exception:  # noqa: BLE001 - only diagnostics
            pass
        out.append({"name": getattr(k, "name", "?"), "regs": getattr(k, "n_regs", None),
                    "spills": getattr(k, "n_spills", None)})
    return out


def _measure(fn, rep_ms):
    before = _compiled()
    res = fn()
    torch.cuda.synchronize()
    regs = _regs(before)
    us = tt.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3
    return res, us, regs


def gqa_case(length, gen):
    """B 32, Hq 32, Hkv 8, D 128 over both caches holding the same values: the inputs, the bf16 cache's output
    (ref), the row label and the bytes each cache's kernel reads."""
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
    return SimpleNamespace(batch=batch, hkv=hkv, q=q, k_cache=k_cache, v_cache=v_cache, kq=kq, ks=ks, vq=vq, vs=vs,
                           table=table, lens=lens, scale=scale, ref=ref,
                           shape=f"gqa B={batch} Hq={hq} Hkv={hkv} L={length} D={dim} bs={BS}",
                           bytes16=4 * batch * length * hkv * dim, bytes8=2 * batch * length * hkv * (dim + 4))


def gqa_rows(length, rep_ms, gen, emit, deadline):
    c = gqa_case(length, gen)
    q, k_cache, v_cache, kq, ks, vq, vs = c.q, c.k_cache, c.v_cache, c.kq, c.ks, c.vq, c.vs
    table, lens, scale, ref, shape, bytes16, bytes8 = c.table, c.lens, c.scale, c.ref, c.shape, c.bytes16, c.bytes8
    batch, hkv = c.batch, c.hkv
    for bn, w, st, sp in itertools.product((64, 128), (4, 8), (2, 3), (0, 2)):
        for kind in ("bf16", "fp8", "fp8_f16"):
            if time.time() > deadline:
                return
            base = DecodeConfig(block_n=bn, num_warps=w, num_stages=st)
            if sp:  # twice the heuristic's splits
                from dsquant.runtime.kernels.attention.split_kv_merge import choose_num_splits, num_sms
                base = DecodeConfig(block_n=bn, num_warps=w, num_stages=st, num_splits=2 * choose_num_splits(
                    batch * hkv, length, 4 * bn, num_sms(q.device)))
            out = torch.full_like(q, float("nan"))
            if kind == "bf16":
                fn = lambda c=base: paged_decode_attention(q, k_cache, v_cache, table, lens, scale,  # noqa: E731
                                                           max_seq_len=length, config=c, out=out)
            else:
                c8 = DecodeConfig(**{**base.__dict__, "fp8_f16": kind == "fp8_f16"})
                fn = lambda c=c8: paged_decode_attention(q, kq, vq, table, lens, scale, max_seq_len=length,  # noqa: E731
                                                         config=c, out=out, k_scale=ks, v_scale=vs)
            try:
                res, us, regs = _measure(fn, rep_ms)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a row too
                emit({"shape": shape, "kind": kind, "config": str(base), "error": repr(e)[:300]})
                continue
            nbytes = bytes16 if kind == "bf16" else bytes8
            emit({"shape": shape, "kind": kind, "config": str(base), "us": us, "GBps": nbytes / us / 1e3,
                  "check": _rel(res, ref), "kernels": regs})


def mla_case(heads, length, gen):
    """B 32, latent 512 + rope 64, both caches holding the same values; as gqa_case."""
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
    return SimpleNamespace(cache=cache, cache8=cache8, q_abs=q_abs, q_pe=q_pe, table=table, lens=lens, scale=scale,
                           ref=ref, shape=f"mla H={heads} B={batch} L={length} bs={BS}",
                           bytes16=batch * length * (RANK + ROPE) * 2,
                           bytes8=batch * length * mla_fp8_token_bytes(RANK, ROPE))


def mla_rows(heads, length, rep_ms, gen, emit, deadline):
    c = mla_case(heads, length, gen)
    cache, cache8, q_abs, q_pe, table, lens, scale = c.cache, c.cache8, c.q_abs, c.q_pe, c.table, c.lens, c.scale
    ref, shape, bytes16, bytes8 = c.ref, c.shape, c.bytes16, c.bytes8
    warps = (4, 8) if heads <= 16 else (8,)
    block_hs = (0,) if heads <= 16 else (32, 64)
    block_ns = (16, 32, 64) if heads <= 16 else (16, 32)
    for bn, w, st, bh in itertools.product(block_ns, warps, (1, 2), block_hs):
        for kind in MLA_KINDS:
            if time.time() > deadline:
                return
            c = MLADecodeConfig(block_h=bh, block_n=bn, num_warps=w, num_stages=st,
                                fold_fp8_scales=kind == "fp8_folded", fp8_f16_dots=kind.endswith("f16"),
                                fp8_prefetch=kind.startswith("fp8_prefetch"))
            out = torch.full_like(q_abs, float("nan"))
            kv = cache if kind == "bf16" else cache8
            fn = lambda c=c, kv=kv: mla_decode_attention(q_abs, q_pe, kv, table, lens, scale,  # noqa: E731
                                                         max_seq_len=length, config=c, out=out)
            try:
                res, us, regs = _measure(fn, rep_ms)
            except Exception as e:  # noqa: BLE001
                emit({"shape": shape, "kind": kind, "config": str(c), "error": repr(e)[:300]})
                continue
            nbytes = bytes16 if kind == "bf16" else bytes8
            emit({"shape": shape, "kind": kind, "config": str(c), "us": us, "GBps": nbytes / us / 1e3,
                  "check": _rel(res, ref), "kernels": regs})


def base_parser():
    """The options this sweep and kv_words_probe.py share."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--rep-ms", type=int, default=30)
    ap.add_argument("--only", default="gqa,mla16,mla128")
    ap.add_argument("--lengths", default="32768,4096")
    return ap


def drive(args, gqa_fn, mla_fn):
    """Every row of gqa_fn / mla_fn(heads, ...) at each length, written to args.out as they come (through
    args.out + ".tmp", renamed at the end)."""
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
            gqa_fn(length, args.rep_ms, gen, emit, deadline)
        for heads in (16, 128):
            if f"mla{heads}" in parts:
                mla_fn(heads, length, args.rep_ms, gen, emit, deadline)
        torch.cuda.empty_cache()
    os.replace(args.out + ".tmp", args.out)


def main():
    ap = base_parser()
    ap.add_argument("--mla-kinds", default=",".join(MLA_KINDS), help="MLA cache/kernel kinds to time")
    args = ap.parse_args()
    MLA_KINDS[:] = args.mla_kinds.split(",")
    drive(args, gqa_rows, mla_rows)


if __name__ == "__main__":
    main()
