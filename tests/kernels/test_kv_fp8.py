"""FP8 KV cache: the torch layout functions, the store kernels that quantize, and the decode /
prefill kernels that dequantize in registers, each against the pure-torch reference.

Properties:
- quantize/dequantize (kv_fp8_layout.py) is within e4m3's rounding of the input, group by group,
  and the MLA token's bytes sit where FlashMLA's layout puts them (656 bytes at R 512, P 64);
- the store kernels write exactly the reference's bytes at exactly their slots (GPU: the cast to
  e4m3 is not faithful under TRITON_INTERPRET; on CPU the scales, rope bytes and slots are checked);
- decode / prefill over an FP8 cache equal float32 attention over the dequantized cache, on ragged
  batches, block boundaries, length 1, several splits, partial head tiles.
Every input has magnitudes spread over orders of magnitude per token and head, so a scale read for
the wrong token, head or group shows; outputs are poisoned with NaN before each launch.
"""
import math

import pytest
import torch

from dsquant.errors import DsquantError
from dsquant.runtime.kernels.attention.kv_fp8_layout import (FP8_DTYPE, dequantize_fp8, dequantize_mla_fp8, mla_fp8_token_bytes,
                                                   mla_fp8_views, quantize_fp8, quantize_mla_fp8)
from dsquant.runtime.kernels.attention.reference_attention import (make_block_table, mla_decode_reference,
                                                         paged_decode_reference, paged_prefill_reference)


def spread(shape, gen, low=-2.0, high=1.0):
    """randn with a magnitude 10**U(low, high) per row of the last dim, and an outlier channel."""
    x = torch.randn(shape, generator=gen)
    x = x * 10 ** (torch.rand(shape[:-1], generator=gen)[..., None] * (high - low) + low)
    x[..., 1] *= 8
    return x


def fp8_gqa_cache(num_blocks, block_size, kv_heads, head_dim, gen, dtype, device):
    """(k_cache, v_cache, k_scale, v_scale) quantized by torch, and their float32 dequantized copies."""
    k, v = (spread((num_blocks, block_size, kv_heads, head_dim), gen, -1.5, 0.5).to(dtype) for _ in range(2))
    (kq, ks), (vq, vs) = quantize_fp8(k), quantize_fp8(v)
    deq = dequantize_fp8(kq, ks), dequantize_fp8(vq, vs)
    return tuple(t.to(device) for t in (kq, vq, ks, vs)), tuple(t.to(device) for t in deq)


def test_layout_sizes_and_byte_positions():
    assert mla_fp8_token_bytes(512, 64) == 656 and 1152 / 656 > 1.75
    gen = torch.Generator().manual_seed(0)
    kv_c, k_pe = spread((3, 256), gen), torch.randn(3, 32, generator=gen)
    rows = quantize_mla_fp8(kv_c, k_pe, torch.bfloat16)  # [3, 256 + 8 + 64]
    assert rows.dtype == torch.uint8 and rows.shape == (3, 328)
    q, scale = quantize_fp8(kv_c.view(3, 2, 128))
    assert torch.equal(rows[:, :256], q.view(3, 256).view(torch.uint8))
    assert torch.equal(rows[:, 256:264].contiguous().view(torch.float32), scale)  # 2 fp32 scales after the latent
    assert torch.equal(rows[:, 264:].contiguous().view(torch.bfloat16), k_pe.bfloat16())  # then the rope key
    latent, scales, pe = mla_fp8_views(rows.view(1, 3, 328), 256, 32, torch.bfloat16)
    assert torch.equal(scales[0], scale) and torch.equal(pe[0], k_pe.bfloat16())
    assert torch.equal(latent[0].float(), q.view(3, 256).float())


def test_quantize_error_is_e4m3_rounding_per_group():
    gen = torch.Generator().manual_seed(1)
    x = spread((64, 4, 128), gen, -4.0, 3.0)
    x[5, 2] = 0  # an all-zero group: zeros back, no NaN
    q, scale = quantize_fp8(x)
    back = dequantize_fp8(q, scale)
    assert torch.isfinite(back).all() and torch.equal(back[5, 2], torch.zeros(128))
    # e4m3: 3 mantissa bits (half an ulp is 1/16 of the value), subnormal spacing 2^-9 of the scale
    assert ((back - x).abs() <= x.abs() / 16 + scale[..., None] * 2 ** -10 + 1e-30).all()
    assert torch.allclose(scale, x.abs().amax(-1).clamp(min=1e-8) / 448)
    kv_c, k_pe = x[:, :2].reshape(64, 256), torch.randn(64, 16, generator=gen)
    rows = dequantize_mla_fp8(quantize_mla_fp8(kv_c, k_pe, torch.float16), 256, 16, torch.float16)
    assert torch.equal(rows[:, :256], back[:, :2].reshape(64, 256))
    assert torch.equal(rows[:, 256:], k_pe.half().float())


# ----------------------------------------------------------------------------- store kernels
def _store_case(device, dtype, kv_heads, head_dim, rank, rope, block_size, num_blocks):
    gen = torch.Generator().manual_seed(kv_heads * head_dim + rank)
    perm = torch.randperm(num_blocks * block_size, generator=gen)
    slots = torch.cat([perm[:9], torch.tensor([-1]), perm[9:12]]).to(device)  # scattered, with a padding token
    t = slots.shape[0]
    qkv = spread((t, 3 * kv_heads * head_dim), gen).to(dtype).to(device)  # strided k, v views, as a fused qkv
    key = qkv[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(t, kv_heads, head_dim)
    value = qkv[:, 2 * kv_heads * head_dim:].view(t, kv_heads, head_dim)
    kv_c, k_pe = spread((t, rank), gen).to(dtype).to(device), torch.randn(t, rope, generator=gen).to(dtype).to(device)
    return slots, key, value, kv_c, k_pe


def _check_store_kv_fp8(device, dtype, kv_heads, head_dim, block_size, num_blocks, exact_values: bool):
    from dsquant.runtime.kernels.attention.kv_store_fp8 import store_kv_fp8

    slots, key, value, _, _ = _store_case(device, dtype, kv_heads, head_dim, 128, 16, block_size, num_blocks)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [torch.randn(shape, device=device).to(FP8_DTYPE) for _ in range(2)]
    scales = [torch.rand(shape[:3], device=device) for _ in range(2)]
    before = [c.clone() for c in caches + scales]
    store_kv_fp8(key, value, *caches, *scales, slots)
    keep = slots >= 0
    for x, cache, scale, old_c, old_s in zip((key, value), caches, scales, before[:2], before[2:]):
        q_ref, s_ref = quantize_fp8(x[keep])
        flat_c, flat_s = cache.view(-1, kv_heads, head_dim), scale.view(-1, kv_heads)
        torch.testing.assert_close(flat_s[slots[keep]], s_ref, rtol=1e-6, atol=0)
        got = flat_c[slots[keep]].float()
        if exact_values:
            assert (got == q_ref.float()).float().mean() >= 0.999
            assert ((got - q_ref.float()).abs() <= q_ref.float().abs() / 8 + 2 ** -9).all()
        untouched = torch.ones(flat_s.shape[0], dtype=torch.bool, device=device)
        untouched[slots[keep]] = False
        assert torch.equal(flat_s[untouched], old_s.view(-1, kv_heads)[untouched])
        assert torch.equal(flat_c[untouched].view(torch.uint8), old_c.view(-1, kv_heads, head_dim)[untouched]
                           .view(torch.uint8))


def _check_store_latent_fp8(device, dtype, rank, rope, block_size, num_blocks, exact_values: bool):
    from dsquant.runtime.kernels.attention.kv_store_fp8 import store_latent_fp8

    slots, _, _, kv_c, k_pe = _store_case(device, dtype, 1, 16, rank, rope, block_size, num_blocks)
    width = mla_fp8_token_bytes(rank, rope)
    cache = torch.randint(0, 255, (num_blocks, block_size, width), dtype=torch.uint8, device=device)
    old = cache.clone()
    store_latent_fp8(kv_c, k_pe, cache, slots, dtype)
    keep = slots >= 0
    ref = quantize_mla_fp8(kv_c[keep], k_pe[keep], dtype)  # [n, W]
    flat = cache.view(-1, width)
    got = flat[slots[keep]]
    assert torch.equal(got[:, rank:], ref[:, rank:])  # scales and rope bytes
    if exact_values:
        q_got, q_ref = got[:, :rank].view(FP8_DTYPE).float(), ref[:, :rank].view(FP8_DTYPE).float()
        assert (q_got == q_ref).float().mean() >= 0.999
        assert ((q_got - q_ref).abs() <= q_ref.abs() / 8 + 2 ** -9).all()
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=device)
    untouched[slots[keep]] = False
    assert torch.equal(flat[untouched], old.view(-1, width)[untouched])


def test_store_fp8_scales_rope_and_slots_cpu(device):
    """Under the interpreter the e4m3 cast itself is not faithful: scales, rope bytes and slots are."""
    _check_store_kv_fp8(device, torch.float16, 3, 32, 16, 4, exact_values=device == "cuda")
    _check_store_latent_fp8(device, torch.float16, 256, 32, 16, 4, exact_values=device == "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_fp8_gpu(block_size, dtype, device):
    _check_store_kv_fp8(device, dtype, 8, 128, block_size, 64, exact_values=True)
    _check_store_kv_fp8(device, dtype, 1, 80, block_size, 64, exact_values=True)  # one kv head, D not a power of 2
    _check_store_latent_fp8(device, dtype, 512, 64, block_size, 64, exact_values=True)
    _check_store_latent_fp8(device, dtype, 128, 32, block_size, 64, exact_values=True)  # one scale group


# ----------------------------------------------------------------------------- read kernels
def _check_decode(device, dtype, seq_lens, block_size, kv_heads, group, head_dim, splits, block_n=32, f16=False):
    from dsquant.runtime.kernels.attention.paged_decode import DecodeConfig, paged_decode_attention

    gen = torch.Generator().manual_seed(sum(seq_lens) + block_size + group)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    table = make_block_table(seq_lens, block_size, num_blocks, gen).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    query = spread((len(seq_lens), kv_heads * group, head_dim), gen, -1.0, 0.5).to(dtype).to(device)
    (kq, vq, ks, vs), (k_deq, v_deq) = fp8_gqa_cache(num_blocks, block_size, kv_heads, head_dim, gen, dtype, device)
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(query, kq, vq, table, lens, scale, out=out, k_scale=ks, v_scale=vs,
                           config=DecodeConfig(block_n=block_n, num_stages=1, num_splits=splits, fp8_f16=f16))
    ref = paged_decode_reference(query, k_deq, v_deq, table, lens, scale)
    assert torch.isfinite(out).all()
    for o, r in zip(out.float(), ref):  # per row: the rows' magnitudes differ by orders of magnitude
        assert (o - r).norm() <= 1e-2 * r.norm() + 1e-6


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("f16", [False, True])  # DecodeConfig.fp8_f16: the dots in fp16
def test_paged_decode_fp8_cpu(block_size, group, splits, f16, device):
    _check_decode(device, torch.float16, [1, 2 * block_size, 3 * block_size + 5, 37], block_size, 2, group, 32, splits,
                  f16=f16)


def _check_prefill(device, dtype, ctx_lens, q_lens, block_size, kv_heads, group, head_dim, block=16):
    from dsquant.runtime.kernels.attention.paged_prefill import PrefillConfig, paged_prefill_attention

    gen = torch.Generator().manual_seed(sum(ctx_lens) + block_size * group)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    table = make_block_table(seq_lens, block_size, num_blocks, gen).to(device)
    tq = sum(q_lens)
    q = spread((tq, kv_heads * group, head_dim), gen, -1.0, 0.5).to(dtype).to(device)
    (kq, vq, ks, vs), (k_deq, v_deq) = fp8_gqa_cache(num_blocks, block_size, kv_heads, head_dim, gen, dtype, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, kq, vq, table, lens, cu, scale, max_q_len=max(q_lens), out=out, k_scale=ks,
                            v_scale=vs, config=PrefillConfig(block_m=block, block_n=block, num_stages=1))
    ref = paged_prefill_reference(q, k_deq, v_deq, table, cu, lens, scale)
    assert torch.isfinite(out).all()
    for o, r in zip(out.float(), ref):
        assert (o - r).norm() <= 1e-2 * r.norm() + 1e-6


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4])
def test_paged_prefill_fp8_cpu(block_size, group, device):
    _check_prefill(device, torch.float16, [0, block_size, 21], [19, block_size, 1], block_size, 2, group, 32)


def _mla_cache(num_blocks, block_size, rank, rope, gen, dtype, device):
    """The uint8 FP8 latent cache quantized by torch, and its float32 dequantized copy [.., .., R + P]."""
    kv_c = spread((num_blocks * block_size, rank), gen, -1.5, 0.5)
    kv_c = kv_c * 10 ** torch.rand(rank // 128, generator=gen).repeat_interleave(128)  # groups of unlike size
    k_pe = spread((num_blocks * block_size, rope), gen, -1.0, 0.5)
    rows = quantize_mla_fp8(kv_c.to(dtype), k_pe.to(dtype), dtype)
    deq = dequantize_mla_fp8(rows, rank, rope, dtype)
    return (rows.view(num_blocks, block_size, -1).to(device),
            deq.view(num_blocks, block_size, rank + rope).to(device))


def _check_mla(device, dtype, seq_lens, block_size, heads, rank, rope, config):
    from dsquant.runtime.kernels.attention.mla_decode import mla_decode_attention

    gen = torch.Generator().manual_seed(sum(seq_lens) + heads + rank)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    table = make_block_table(seq_lens, block_size, num_blocks, gen).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q_nope = (spread((len(seq_lens), heads, rank), gen, -1.0, 0.5) / math.sqrt(rank)).to(dtype).to(device)
    q_pe = spread((len(seq_lens), heads, rope), gen, -1.0, 0.5).to(dtype).to(device)
    cache, deq = _mla_cache(num_blocks, block_size, rank, rope, gen, dtype, device)
    scale = 1.0 / math.sqrt(rank // 4 + rope)
    out = torch.full_like(q_nope, float("nan"))
    mla_decode_attention(q_nope, q_pe, cache, table, lens, scale, config=config, out=out)
    ref = mla_decode_reference(q_nope, q_pe, deq, table, lens, scale)
    assert torch.isfinite(out).all()
    for o, r in zip(out.float(), ref):
        assert (o - r).norm() <= 1e-2 * r.norm() + 1e-6


# one, two, four and eight scale groups; fold: mla_decode_fp8.py's kernel (scales folded into the dots,
# R <= 512; R = 1024 keeps the dequantizing kernel), with fp16 dots too
@pytest.mark.parametrize("rank", [128, 256, 512, 1024])
@pytest.mark.parametrize("heads,splits", [(4, 1), (20, 3)])  # a partial head tile; split-KV merge
@pytest.mark.parametrize("fold,f16,prefetch", [(False, False, False), (False, True, False), (True, False, False),
                                               (True, True, False), (False, False, True), (False, True, True)])
def test_mla_decode_fp8_cpu(rank, heads, splits, fold, f16, prefetch, device):
    """prefetch: mla_decode_fp8_prefetch.py's kernel (the next tile's loads carried one iteration ahead)."""
    from dsquant.runtime.kernels.attention.mla_decode import MLADecodeConfig

    config = MLADecodeConfig(block_h=16, block_n=16, num_stages=1, num_splits=splits, fold_fp8_scales=fold,
                             fp8_f16_dots=f16, fp8_prefetch=prefetch)
    _check_mla(device, torch.float16, [1, 32, 16 * 3 + 5], 16, heads, rank, 16, config)


def test_fp8_read_kernels_refuse_a_cache_without_scales(device):
    from dsquant.runtime.kernels.attention.mla_decode import mla_decode_attention
    from dsquant.runtime.kernels.attention.paged_decode import paged_decode_attention

    gen = torch.Generator().manual_seed(0)
    (kq, vq, _, _), _ = fp8_gqa_cache(2, 16, 1, 32, gen, torch.float16, device)
    q = torch.randn(1, 2, 32, dtype=torch.float16, device=device)
    table, one = torch.zeros(1, 1, dtype=torch.int32, device=device), torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(DsquantError, match="k_scale and v_scale"):
        paged_decode_attention(q, kq, vq, table, one, 0.1)
    bad = torch.zeros(2, 16, 128 + 16, dtype=torch.uint8, device=device)  # not 128 + 4 + 2 x 16 bytes
    with pytest.raises(DsquantError, match="uint8"):
        mla_decode_attention(torch.randn(1, 16, 128, dtype=torch.float16, device=device),
                             torch.randn(1, 16, 16, dtype=torch.float16, device=device), bad, table, one, 0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_fp8_read_kernels_gpu(dtype, device):
    """Full-size shapes: Llama/Qwen heads (D 128, groups 1 and 7), V2-Lite's 16 and V3's 128 MLA heads."""
    from dsquant.runtime.kernels.attention.mla_decode import MLADecodeConfig

    lens = [1, 64, 1000, 4096 + 7]
    _check_decode(device, dtype, lens, 16, 8, 1, 128, splits=0, block_n=64)
    _check_decode(device, dtype, lens, 64, 4, 7, 128, splits=4, block_n=64)
    _check_decode(device, dtype, lens, 64, 8, 4, 128, splits=0, block_n=128, f16=True)
    _check_prefill(device, dtype, [0, 64, 1000], [200, 64, 1], 16, 4, 7, 128, block=64)
    for heads in (16, 128):
        _check_mla(device, dtype, lens, 64, heads, 512, 64, MLADecodeConfig())
        _check_mla(device, dtype, lens, 64, heads, 512, 64, MLADecodeConfig(fp8_f16_dots=True))
        _check_mla(device, dtype, lens, 64, heads, 512, 64, MLADecodeConfig(fold_fp8_scales=True))
        _check_mla(device, dtype, lens, 64, heads, 512, 64, MLADecodeConfig(fold_fp8_scales=True, fp8_f16_dots=True))
        _check_mla(device, dtype, lens, 64, heads, 512, 64, MLADecodeConfig(fp8_prefetch=True))
        _check_mla(device, dtype, lens, 64, heads, 512, 64, MLADecodeConfig(fp8_prefetch=True, fp8_f16_dots=True))


def test_mla_fp8_default_config():
    """An FP8 cache with <= 16 heads takes the prefetching kernel over 16-token tiles (FP8_CONFIG); a bf16
    cache with more heads 64-token tiles (WIDE_CONFIG); the rest MLADecodeConfig(), with 1-tile splits
    at small batches."""
    from dsquant.runtime.kernels.attention.mla_decode_plan import FP8_CONFIG, WIDE_CONFIG, MLADecodeConfig, default_config

    fp8_cache, bf16_cache = torch.zeros(2, 16, 656, dtype=torch.uint8), torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    assert default_config(fp8_cache, 16) == FP8_CONFIG and FP8_CONFIG.fp8_prefetch and FP8_CONFIG.block_n == 16
    assert default_config(bf16_cache, 128) == WIDE_CONFIG and WIDE_CONFIG.block_n == 64
    assert default_config(fp8_cache, 128) == MLADecodeConfig() == default_config(bf16_cache, 16)
    # a bf16 cache at <= 16 heads: 1-tile splits up to SMALL_BATCH sequences, 4-tile ones beyond
    assert default_config(bf16_cache, 16, batch=1) == MLADecodeConfig(min_split_tiles=1)
    assert default_config(bf16_cache, 16, batch=4).min_split_tiles == 1
    assert default_config(bf16_cache, 16, batch=5) == MLADecodeConfig() and MLADecodeConfig().min_split_tiles == 4
    assert default_config(fp8_cache, 16, batch=1) == FP8_CONFIG and default_config(bf16_cache, 128, 1) == WIDE_CONFIG
