"""FP8-KV-cache decode with the tiles read as words (issue 23: decode at 32K >= 1.3x the bf16 cache), on the GPU.

    PYTHONPATH=. python scripts/kv_words_probe.py OUT.json [--budget-s 300] [--only gqa,mla16,mla128]

At B 32, L 32768 and 4096, block size 64, each a CUDA-graph median with the compiled kernel's registers and
spills (kvfp8_sweep.py's measuring): the bf16 cache at its defaults (and the configs that were its best), the
FP8 cache at today's defaults, and the words kernels (paged_decode_fp8.py, mla_decode_fp8_words.py) over a
grid of launch configs. GQA: Hq 32, Hkv 8, D 128. MLA: 16 and 128 heads, latent 512 + rope 64. Outputs are
checked against the bf16 cache's (the e4m3 rounding: a few 1e-2). Rows are written as they come.
"""
import itertools
import time

import torch
from kvfp8_sweep import KERNELS, _measure, base_parser, drive, gqa_case, mla_case

from dsquant.bench.attention_common import _rel
from dsquant.runtime.kernels.attention.mla_decode import MLADecodeConfig, mla_decode_attention
from dsquant.runtime.kernels.attention.mla_decode_fp8_words import mla_decode_fp8_words_kernel
from dsquant.runtime.kernels.attention.paged_decode import DecodeConfig, paged_decode_attention
from dsquant.runtime.kernels.attention.paged_decode_fp8 import paged_decode_fp8_words_kernel
from dsquant.runtime.kernels.attention.split_kv_merge import choose_num_splits, num_sms

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
    c = gqa_case(length, gen)
    for kind, config in _gqa_configs(c.batch, c.hkv, length):
        if time.time() > deadline:
            return
        out = torch.full_like(c.q, float("nan"))
        if kind == "bf16":
            fn = lambda cf=config: paged_decode_attention(c.q, c.k_cache, c.v_cache, c.table, c.lens,  # noqa: E731
                                                          c.scale, max_seq_len=length, config=cf, out=out)
        else:
            fn = lambda cf=config: paged_decode_attention(c.q, c.kq, c.vq, c.table, c.lens, c.scale,  # noqa: E731
                                                          max_seq_len=length, config=cf, out=out, k_scale=c.ks,
                                                          v_scale=c.vs)
        _emit(emit, c.shape, kind, config, fn, c.ref, c.bytes16 if kind == "bf16" else c.bytes8, rep_ms)


def _mla_configs(heads):
    if heads <= 16:  # (block_n, num_warps, num_stages, max_regs, lazy); max_regs 168: three programs an SM
        rows = [("bf16", None), ("bf16", MLADecodeConfig(max_regs=168)), ("bf16", MLADecodeConfig(block_n=16)), ("fp8", None)]
        grid = ((16, 4, 2, 0, False), (16, 4, 2, 168, False), (16, 4, 2, 128, False), (32, 4, 2, 0, False),
                (32, 4, 2, 168, False), (32, 4, 3, 168, False), (16, 4, 3, 168, False), (64, 4, 2, 0, False),
                (16, 4, 3, 0, False), (16, 4, 1, 0, False), (32, 4, 3, 0, False), (16, 8, 2, 0, False),
                (32, 8, 2, 0, False), (64, 8, 2, 0, False), (16, 4, 2, 0, True), (16, 4, 2, 168, True))
        for bn, w, st, mr, lazy in grid:
            rows.append(("fp8", MLADecodeConfig(block_n=bn, num_warps=w, num_stages=st, max_regs=mr, fp8_words=True,
                                                lazy_rescale=lazy)))
        return rows
    rows = [("bf16", None), ("fp8", None)]
    for bh, bn, w, st in itertools.product((32, 64), (16, 32), (8,), (1, 2)):
        rows.append(("fp8", MLADecodeConfig(block_h=bh, block_n=bn, num_warps=w, num_stages=st, fp8_words=True)))
    for bh, bn, w, st in ((64, 16, 8, 1), (64, 16, 8, 2), (64, 32, 8, 2), (32, 32, 8, 2)):
        rows.append(("fp8", MLADecodeConfig(block_h=bh, block_n=bn, num_warps=w, num_stages=st, fp8_words=True,
                                            lazy_rescale=True)))  # the rescale only in tiles that need it
    return rows


def mla_rows(heads, length, rep_ms, gen, emit, deadline):
    c = mla_case(heads, length, gen)
    for kind, config in _mla_configs(heads):
        if time.time() > deadline:
            return
        out = torch.full_like(c.q_abs, float("nan"))
        kv = c.cache if kind == "bf16" else c.cache8
        fn = lambda cf=config, kv=kv: mla_decode_attention(c.q_abs, c.q_pe, kv, c.table, c.lens, c.scale,  # noqa: E731
                                                           max_seq_len=length, config=cf, out=out)
        _emit(emit, c.shape, kind, config, fn, c.ref, c.bytes16 if kind == "bf16" else c.bytes8, rep_ms)


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
    drive(base_parser().parse_args(), gqa_rows, mla_rows)


if __name__ == "__main__":
    main()
