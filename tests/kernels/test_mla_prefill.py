"""Unabsorbed MLA prefill (kernels/attention/mla_prefill.py): the keys expanded from the paged latent
cache and the causal flash-attention kernel over them equal float32 attention with per-head keys
[W_UK c ; k_pe] and values W_UV c, computed here sequence by sequence from the pages.

Covers plain prefill (no context), chunked prefill with a cached prefix, a single new token after a
long prefix, query and key tiles cut by the sequence ends, and the FP8 latent cache. Latent and
query magnitudes vary by orders of magnitude per token, with an outlier channel; outputs are
poisoned with NaN before the launch.
"""
import math

import pytest
import torch

from dsquant.runtime.kernels.attention.kv_fp8_layout import dequantize_mla_fp8, quantize_mla_fp8
from dsquant.runtime.kernels.attention.mla_prefill import (MLAPrefillConfig, expand_keys, mla_prefill_attention,
                                                           supported)
from dsquant.runtime.kernels.attention.reference_attention import gather_paged, make_block_table


def spread(shape, gen, low=-1.5, high=0.5):
    x = torch.randn(shape, generator=gen)
    x = x * 10 ** (torch.rand(shape[:-1], generator=gen)[..., None] * (high - low) + low)
    x[..., 1] *= 8
    return x


def reference(q_nope, q_pe, cache, table, seq_lens, q_lens, w_uk, w_uv, scale):
    """float32 [T, H, V], sequence by sequence; cache holds the (dequantized) latent + rope key."""
    rank = w_uk.shape[-1]
    outs, start = [], 0
    for b, (n, q_len) in enumerate(zip(seq_lens, q_lens)):
        rows = gather_paged(cache.float(), table[b], n)  # [n, R + P]
        lat, pe = rows[:, :rank], rows[:, rank:]
        k = torch.cat([torch.einsum("sr,hnr->hsn", lat, w_uk.float()),
                       pe[None].expand(w_uk.shape[0], -1, -1)], dim=-1)  # [H, n, nope + rope]
        v = torch.einsum("sr,hvr->hsv", lat, w_uv.float())  # [H, n, V]
        q = torch.cat([q_nope[start:start + q_len], q_pe[start:start + q_len]], dim=-1).float().transpose(0, 1)
        s = q @ k.transpose(1, 2) * scale  # [H, q_len, n]
        pos = torch.arange(n - q_len, n)[:, None]
        s = s.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
        outs.append((s.softmax(-1) @ v).transpose(0, 1))  # [q_len, H, V]
        start += q_len
    return torch.cat(outs)


def _check(device, dtype, seq_lens, q_lens, block_size, heads, rank, nope, rope, vdim, config, fp8=False):
    gen = torch.Generator().manual_seed(sum(seq_lens) + heads + rank + fp8)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    table = make_block_table(seq_lens, block_size, num_blocks, gen).to(device)
    lat = spread((num_blocks, block_size, rank), gen)
    pe = spread((num_blocks, block_size, rope), gen, -1.0, 0.5)
    if fp8:
        rows = quantize_mla_fp8(lat.reshape(-1, rank).to(dtype), pe.reshape(-1, rope).to(dtype), dtype)
        cache = rows.view(num_blocks, block_size, -1).to(device)
        held = dequantize_mla_fp8(rows, rank, rope, dtype).view(num_blocks, block_size, -1)
    else:
        cache = torch.cat([lat, pe], -1).to(dtype).to(device)
        held = cache.float().cpu()
    w_uk = (torch.randn(heads, nope, rank, generator=gen) / math.sqrt(rank)).to(dtype)
    w_uv = (torch.randn(heads, vdim, rank, generator=gen) / math.sqrt(rank)).to(dtype)
    t = sum(q_lens)
    q_nope = (spread((t, heads, nope), gen, -1.0, 0.5) / math.sqrt(nope)).to(dtype)
    q_pe = spread((t, heads, rope), gen, -1.0, 0.5).to(dtype)
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = 1.0 / math.sqrt(nope + rope)

    k_nope, k_pe, v, cu_k = expand_keys(cache, table, lens, sum(seq_lens), w_uk.to(device), w_uv.to(device), rope,
                                        dtype)
    assert cu_k.tolist() == [0] + torch.tensor(seq_lens).cumsum(0).tolist()
    out = torch.full((t, heads, vdim), float("nan"), dtype=dtype, device=device)
    mla_prefill_attention(q_nope.to(device), q_pe.to(device), k_nope, k_pe, v, cu_q, cu_k, max(q_lens), scale,
                          config=config, out=out)
    ref = reference(q_nope, q_pe, held, table.cpu(), seq_lens, q_lens, w_uk, w_uv, scale)
    assert torch.isfinite(out).all()
    for o, r in zip(out.float().cpu(), ref):  # per token: magnitudes differ by orders of magnitude
        assert (o - r).norm() <= 2e-2 * r.norm() + 1e-5


# (seq_lens, q_lens): prefill from scratch, a chunk after a prefix, one token after a long prefix
CASES = [([19], [19]), ([5, 70, 130], [5, 33, 1]), ([40, 33], [17, 33])]


@pytest.mark.parametrize("seq_lens,q_lens", CASES)
@pytest.mark.parametrize("fp8", [False, True])
def test_mla_prefill_cpu(seq_lens, q_lens, fp8, device):
    config = MLAPrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    _check(device, torch.float16, seq_lens, q_lens, 16, 3, 128, 32, 16, 32, config, fp8=fp8)


def test_supported_dims():
    assert supported(128, 64, 128) and supported(16, 16, 16)
    assert not supported(96, 64, 128) and not supported(128, 8, 128)
    with pytest.raises(ValueError, match="powers of two"):
        x = torch.zeros(2, 1, 24)
        mla_prefill_attention(x, torch.zeros(2, 1, 16), x, torch.zeros(2, 16), x,
                              torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32), 2, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_mla_prefill_gpu(fp8, device):
    """DeepSeek's dims (R 512, nope 128, rope 64, v 128), 16 heads, bf16, the default tiles."""
    _check(device, torch.bfloat16, [1000, 64, 4096 + 7, 300], [1000, 1, 517, 129], 64, 16, 512, 128, 64, 128,
           MLAPrefillConfig(), fp8=fp8)


# ------------------------------------------------- the backend's choice, with kv_b_proj quantized
def _refuse_absorbed(monkeypatch):
    from dsquant.runtime.layers.attention_triton import TritonPagedAttention

    def refuse(*args, **kwargs):
        raise AssertionError("a long prefill step took the absorbed path")

    monkeypatch.setattr(TritonPagedAttention, "_attend_absorbed", refuse)


@pytest.mark.parametrize("fmt", ["fp8", "awq", "gptq_act_order"])
@pytest.mark.parametrize("path", ["mla", "fused"])
def test_long_prefill_goes_unabsorbed(fmt, path, monkeypatch, device):
    """TritonPagedAttention sends a prefill step whose FLOPs favour it through expand_keys +
    mla_prefill_attention, with W_UK / W_UV from a quantized kv_b_proj; same float64 reference as the
    absorbed path's test (test_mla_absorb_quantized.py)."""
    from tests.kernels.test_mla_absorb_quantized import CPU_TOL, FORMATS, SMALL, check_attention

    assert fmt in FORMATS
    _refuse_absorbed(monkeypatch)
    check_attention(fmt, path, False, device, torch.float16, **dict(SMALL, v=32), ctx_lens=[0, 21], q_lens=[130, 70],
                    tol=CPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "awq"])
@pytest.mark.parametrize("heads", [16, 128])
def test_long_prefill_goes_unabsorbed_gpu(fmt, heads, monkeypatch):
    from tests.kernels.test_mla_absorb_quantized import GPU_TOL, V2_LITE, check_attention

    _refuse_absorbed(monkeypatch)
    check_attention(fmt, "fused", False, "cuda", torch.bfloat16, **dict(V2_LITE, heads=heads), ctx_lens=[0, 700],
                    q_lens=[1000, 300], block_size=64, tol=GPU_TOL)


def test_which_steps_go_unabsorbed():
    """The FLOP rule and the memory cap of TritonPagedAttention._unabsorbed, on DeepSeek's dims."""
    from types import SimpleNamespace

    from dsquant.runtime.layers import attention_triton as at

    def step(q_lens, seq_lens, heads=16, decode=False):
        module = SimpleNamespace(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512,
                                 num_heads=heads)
        ctx = SimpleNamespace(is_decode=decode, q_lens_host=q_lens, seq_lens_host=seq_lens)
        return at.TritonPagedAttention._unabsorbed(module, ctx)

    assert step([8192], [8192]) and step([8192], [131072])  # a long prompt's first and last chunks
    assert not step([1] * 8, [4096] * 8, decode=True)  # decode
    assert not step([1, 1, 20], [32768, 32768, 20])  # a short prompt beside long decodes: expanding costs more
    assert not step([8192], [131072], heads=128)  # 8.6 GB of expanded keys on one rank: absorbed
    assert not at.TritonPagedAttention._unabsorbed(SimpleNamespace(qk_nope_head_dim=96, qk_rope_head_dim=64,
                                                                   v_head_dim=128, kv_lora_rank=512, num_heads=16),
                                                   SimpleNamespace(is_decode=False, q_lens_host=[512],
                                                                   seq_lens_host=[512]))  # nope 96: no kernel
