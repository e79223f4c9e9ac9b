"""Decode over the FP8 cache with the e4m3 tiles read as int32 words and the dots in fp16, the query and the
probabilities times the value scales normalized by powers of two: GQA through paged_decode_fp8.py
(DecodeConfig(fp8_words=True)), MLA through mla_decode_fp8_words.py (MLADecodeConfig(fp8_words=True)).

Properties:
- equal to float32 attention over the dequantized cache (reference_attention.py) on ragged batches, block
  boundaries, length 1, several splits, partial group tiles, D not a power of two;
- the normalizations hold at extremes: queries and values whose magnitudes span five to nine orders per token
  and head, where fp16 without them underflows;
- a cache the words cannot read (D not a multiple of 4) falls back to paged_decode.py's kernel;
- on the GPU (inline PTX conversion, bf16 query): full-size shapes, and an error no larger than the bf16-dot
  kernel's against a float64 reference.
Outputs are poisoned with NaN before each launch.
"""
import math

import pytest
import torch

from dsquant.runtime.kernels.attention.kv_fp8_layout import dequantize_fp8, quantize_fp8
from dsquant.runtime.kernels.attention.fp8_words import words_fit
from dsquant.runtime.kernels.attention.paged_decode import DecodeConfig, paged_decode_attention
from dsquant.runtime.kernels.attention.reference_attention import make_block_table, paged_decode_reference
from tests.kernels.test_kv_fp8 import _check_mla, spread


def _case(device, dtype, seq_lens, block_size, kv_heads, group, head_dim, q_range=(-1.0, 0.5),
          kv_range=(-1.5, 0.5), seed=0):
    gen = torch.Generator().manual_seed(seed + sum(seq_lens) + block_size + group + head_dim)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    table = make_block_table(seq_lens, block_size, num_blocks, gen).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    query = spread((len(seq_lens), kv_heads * group, head_dim), gen, *q_range).to(dtype).to(device)
    k, v = (spread((num_blocks, block_size, kv_heads, head_dim), gen, *kv_range).to(dtype) for _ in range(2))
    (kq, ks), (vq, vs) = quantize_fp8(k), quantize_fp8(v)
    caches = tuple(t.to(device) for t in (kq, vq, ks, vs))
    deq = dequantize_fp8(kq, ks).to(device), dequantize_fp8(vq, vs).to(device)
    return query, caches, deq, table, lens


def _run(query, caches, table, lens, config):
    kq, vq, ks, vs = caches
    out = torch.full_like(query, float("nan"))
    scale = 1.0 / math.sqrt(query.shape[-1])
    paged_decode_attention(query, kq, vq, table, lens, scale, out=out, k_scale=ks, v_scale=vs, config=config)
    return out


def _check(device, dtype, seq_lens, block_size, kv_heads, group, head_dim, splits, block_n=32, tol=1e-2, **kw):
    query, caches, (k_deq, v_deq), table, lens = _case(device, dtype, seq_lens, block_size, kv_heads, group,
                                                       head_dim, **kw)
    out = _run(query, caches, table, lens, DecodeConfig(block_n=block_n, num_stages=1, num_splits=splits,
                                                        fp8_words=True))
    ref = paged_decode_reference(query, k_deq, v_deq, table, lens, 1.0 / math.sqrt(head_dim))
    assert torch.isfinite(out).all()
    for o, r in zip(out.float().flatten(0, 1), ref.flatten(0, 1)):  # per head: magnitudes differ by orders
        assert (o - r).norm() <= tol * r.norm() + 1e-30, ((o - r).norm() / r.norm()).item()


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("splits", [1, 3])
def test_words_decode_cpu(block_size, group, splits, device):
    _check(device, torch.float16, [1, 2 * block_size, 3 * block_size + 5, 37], block_size, 2, group, 32, splits)


def test_words_decode_partial_dims_cpu(device):
    """D 36 (a BLOCK_D of 64 with 7 word columns masked), 3 heads a group (a padded group tile)."""
    _check(device, torch.float16, [5, 40], 16, 2, 3, 36, splits=2)


def test_words_decode_extreme_magnitudes_cpu(device):
    """Queries over 10^-6 .. 10^-1 and keys / values over 10^-7 .. 10^2 per token and head (larger products make
    the softmax one-hot on near-ties, a test of fp32 rather than of the kernel). In fp16 without the power-of-two
    normalizations the small queries underflow, and a head whose top token has a tiny value scale loses its
    output: paged_decode.py's fp16-dot path is 10.6% off on one head here, this kernel 0.08%."""
    _check(device, torch.float16, [33, 70], 16, 2, 4, 32, splits=2, q_range=(-6.0, -1.0), kv_range=(-7.0, 2.0),
           tol=2e-3)


def test_words_fit_and_fallback(device):
    gen = torch.Generator().manual_seed(3)
    kq, _ = quantize_fp8(torch.randn(4, 16, 2, 18, generator=gen))
    assert not words_fit(kq, kq)  # 18 codes a row: rows not 4-byte aligned
    kq32, _ = quantize_fp8(torch.randn(4, 16, 2, 32, generator=gen))
    assert words_fit(kq32, kq32) and not words_fit(kq32[..., 1:], kq32[..., 1:])
    # D 18 takes paged_decode.py's kernel, and still matches the reference
    _check(device, torch.float16, [9, 20], 16, 2, 2, 18, splits=1)


def test_mla_views_share_rows():
    """The MLA words kernel takes the scales' and rope key's offsets from the latent's byte row: FlashMLA's
    layout gives three views with equal byte strides at every rank; views of different caches do not."""
    from dsquant.runtime.kernels.attention.kv_fp8_layout import mla_fp8_token_bytes, mla_fp8_views
    from dsquant.runtime.kernels.attention.kv_fp8_layout import rows_shared as _rows_shared

    for rank, rope in ((128, 16), (256, 64), (512, 64), (1024, 64)):
        cache = torch.zeros(3, 16, mla_fp8_token_bytes(rank, rope), dtype=torch.uint8)
        assert _rows_shared(*mla_fp8_views(cache, rank, rope, torch.bfloat16))
    wide = torch.zeros(3, 16, mla_fp8_token_bytes(512, 64) + 16, dtype=torch.uint8)[..., :656]
    latent, scales, _ = mla_fp8_views(torch.zeros(3, 16, 656, dtype=torch.uint8), 512, 64, torch.bfloat16)
    assert not _rows_shared(latent, scales, wide.view(torch.bfloat16)[..., 264:328])


# one, two and four scale groups (R 1024 keeps the dequantizing kernel); a partial head tile; split-KV merge
@pytest.mark.parametrize("rank", [128, 256, 512, 1024])
@pytest.mark.parametrize("heads,splits", [(4, 1), (20, 3)])
@pytest.mark.parametrize("lazy", [False, True])  # MLADecodeConfig.lazy_rescale: rescale only when needed
def test_mla_words_decode_cpu(rank, heads, splits, lazy, device):
    from dsquant.runtime.kernels.attention.mla_decode import MLADecodeConfig

    config = MLADecodeConfig(block_h=16, block_n=16, num_stages=1, num_splits=splits, fp8_words=True,
                             lazy_rescale=lazy)
    _check_mla(device, torch.float16, [1, 32, 16 * 3 + 5], 16, heads, rank, 16, config)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n", [64, 128])
def test_words_decode_gpu(block_n, device):
    """Full size, bf16 queries, inline-PTX conversion: Llama / Qwen heads (D 128, groups 1, 4, 7), many splits,
    and magnitudes over ten orders."""
    lens = [1, 64, 1000, 4096 + 7]
    _check(device, torch.bfloat16, lens, 16, 8, 1, 128, splits=0, block_n=block_n)
    _check(device, torch.bfloat16, lens, 64, 8, 4, 128, splits=0, block_n=block_n)
    _check(device, torch.bfloat16, lens, 64, 4, 7, 128, splits=4, block_n=block_n)
    _check(device, torch.bfloat16, [300, 2000], 64, 2, 4, 128, splits=0, block_n=block_n, q_range=(-6.0, -1.0),
           kv_range=(-7.0, 2.0))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_mla_words_decode_gpu(heads, device):
    """V2-Lite's 16 and V3's 128 MLA heads, R 512, P 64, bf16, with the default tiles and two others."""
    from dsquant.runtime.kernels.attention.mla_decode import MLADecodeConfig

    lens = [1, 64, 1000, 4096 + 7]
    for block_n in (16, 32, 64):
        for lazy in (False, True):
            _check_mla(device, torch.bfloat16, lens, 64, heads, 512, 64,
                       MLADecodeConfig(block_n=block_n, fp8_words=True, lazy_rescale=lazy))
    for block_n, max_regs in (((16, 168), (16, 128), (32, 168)) if heads <= 16 else ()):  # a register cap
        _check_mla(device, torch.bfloat16, lens, 64, heads, 512, 64,
                   MLADecodeConfig(block_n=block_n, fp8_words=True, max_regs=max_regs))


@pytest.mark.gpu
def test_words_decode_precision_gpu(device):
    """Against float64 attention over the dequantized cache, the words kernel's error is within 1.1x the
    bf16-dot kernel's (it should be lower: fp16 keeps three more mantissa bits of q and p)."""
    query, caches, (k_deq, v_deq), table, lens = _case(device, torch.bfloat16, [4096, 777, 3000], 64, 8, 4, 128)
    ref = paged_decode_reference(query.double(), k_deq.double(), v_deq.double(), table, lens, 1 / math.sqrt(128))
    errs = {}
    for name, cfg in (("words", DecodeConfig(fp8_words=True)), ("bf16", DecodeConfig())):
        out = _run(query, caches, table, lens, cfg)
        errs[name] = ((out.double() - ref).norm() / ref.norm()).item()
    assert errs["words"] <= 1.1 * errs["bf16"], errs
