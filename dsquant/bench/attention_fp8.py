"""`dsquant bench attention --kv-cache-dtype fp8`: the decode kernels over the FP8 KV cache beside the
same kernels over the bf16 cache holding the same values (issue 23: decode at 32K context >= 1.3x).

Rows: GQA decode (D 128) and MLA decode (16 and 128 heads, latent 512 + rope 64, FlashMLA's 656-byte
token) at L 4096 and 32768. `x peer` is the bf16 cache's time over the FP8 cache's (CUDA-graph
medians), `achieved` the FP8 cache's bytes read per second, `check` the relative difference of the
two outputs (the FP8 rounding: a few 1e-2). MLA rows: what runs (mla_decode.default_config), then the
tile-dequantizing kernel, the one that folds the scales into the dots (mla_decode_fp8.py) and the words kernel
(mla_decode_fp8_words.py), each at MLADecodeConfig's defaults.
"""
from __future__ import annotations

import math

from dsquant.bench.attention_common import RANK, ROPE, Row, _paged_copy, _rel, _time

FP8_GQA_SHAPES = [(32, 32, 8, 4096, 128), (32, 32, 8, 32768, 128)]
FP8_MLA = [(16, 32, 4096), (16, 32, 32768), (128, 32, 4096), (128, 32, 32768)]  # (heads, batch, length)


def _gqa(shape, block_size, gen, dev="cuda") -> Row:
    import torch

    from dsquant.runtime.kernels.attention.kv_fp8_layout import quantize_fp8
    from dsquant.runtime.kernels.attention.paged_decode import FP8_CONFIG, paged_decode_attention

    batch, hq, hkv, length, dim = shape
    q = torch.randn(batch, hq, dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(batch, length, hkv, dim, device=dev, dtype=torch.bfloat16)
    k_cache, table = _paged_copy(k, block_size, gen)
    v_cache = torch.randn_like(k_cache)
    del k
    (kq, ks), (vq, vs) = quantize_fp8(k_cache), quantize_fp8(v_cache)
    lens = torch.full((batch,), length, dtype=torch.int32, device=dev)
    scale, out, out8 = 1.0 / math.sqrt(dim), torch.empty_like(q), torch.empty_like(q)

    def bf16():
        return paged_decode_attention(q, k_cache, v_cache, table, lens, scale, max_seq_len=length, out=out)

    def fp8():
        return paged_decode_attention(q, kq, vq, table, lens, scale, max_seq_len=length, out=out8, k_scale=ks,
                                      v_scale=vs)

    check = _rel(fp8(), bf16())
    (g, e), (pg, pe) = _time(fp8), _time(bf16)
    bytes_read = 2 * batch * length * hkv * (dim + 4)
    return Row("gqa_fp8", f"B={batch} Hq={hq} Hkv={hkv} L={length} D={dim} bs={block_size}", g, e, pg, pe,
               pg / g, bytes_read / g / 1e3, "GB/s", check, str(FP8_CONFIG))


def _mla(heads, batch, length, block_size, gen, dev="cuda") -> list[Row]:
    import torch

    from dsquant.runtime.kernels.attention.kv_fp8_layout import mla_fp8_token_bytes, quantize_mla_fp8
    from dsquant.runtime.kernels.attention.mla_decode import MLADecodeConfig, default_config, mla_decode_attention

    latent = torch.randn(batch, length, RANK + ROPE, device=dev, dtype=torch.bfloat16)  # [B, L, 576]
    cache, table = _paged_copy(latent, block_size, gen)
    del latent
    flat = cache.view(-1, RANK + ROPE)
    cache8 = quantize_mla_fp8(flat[:, :RANK], flat[:, RANK:], torch.bfloat16).view(*cache.shape[:2], -1)
    q_abs = torch.randn(batch, heads, RANK, device=dev, dtype=torch.bfloat16) / math.sqrt(RANK)
    q_pe = torch.randn(batch, heads, ROPE, device=dev, dtype=torch.bfloat16)
    lens = torch.full((batch,), length, dtype=torch.int32, device=dev)
    scale, out, out8 = 1.0 / math.sqrt(192), torch.empty_like(q_abs), torch.empty_like(q_abs)

    def bf16():
        return mla_decode_attention(q_abs, q_pe, cache, table, lens, scale, max_seq_len=length, out=out)

    def fp8(config=None):  # None: mla_decode.default_config (FP8_CONFIG at <= 16 heads)
        return mla_decode_attention(q_abs, q_pe, cache8, table, lens, scale, max_seq_len=length, out=out8,
                                    config=config)

    check = _rel(fp8(), bf16())
    (g, e), (pg, pe) = _time(fp8), _time(bf16)
    bytes_read = batch * length * mla_fp8_token_bytes(RANK, ROPE)
    what = f"H={heads} B={batch} L={length} bs={block_size}"
    rows = [Row("mla_fp8", what, g, e, pg, pe, pg / g, bytes_read / g / 1e3, "GB/s", check,
                str(default_config(cache8, heads)))]
    for kind, config in (("mla_fp8_dequant", MLADecodeConfig()),
                         ("mla_fp8_folded", MLADecodeConfig(fold_fp8_scales=True)),
                         ("mla_fp8_words", MLADecodeConfig(fp8_words=True))):
        check = _rel(fp8(config), bf16())
        (g, e) = _time(lambda config=config: fp8(config))
        rows.append(Row(kind, what, g, e, pg, pe, pg / g, bytes_read / g / 1e3, "GB/s", check, str(config)))
    return rows


def fp8_rows(block_size: int, gen, emit) -> list[Row]:
    """Every FP8-cache row; emit(row) as each is measured."""
    import torch

    rows = []
    for shape in FP8_GQA_SHAPES:
        rows.append(_gqa(shape, block_size, gen))
        emit(rows[-1])
        torch.cuda.empty_cache()
    for heads, batch, length in FP8_MLA:
        for row in _mla(heads, batch, length, block_size, gen):
            rows.append(row)
            emit(row)
        torch.cuda.empty_cache()
    return rows
