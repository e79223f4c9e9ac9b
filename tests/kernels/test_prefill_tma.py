"""The TMA prefill kernel (new tokens' K/V from the projections, the prefix from the pages) equals
float32 masked attention over each sequence's paged keys.

As test_paged_prefill.py: the new tokens are stored with store_kv first, so the reference reads
everything from the cache, while the kernel reads the new keys from k_new / v_new. Plain prefill,
chunked prefill and prefix hits with a context that ends mid-tile, outlier keys that move a
row's maximum late, one new token after a long context, query tiles that end mid-sequence (the next sequence's rows in the box), GQA groups 1/4/8.
Outputs poisoned with NaN; the caches' unused slots hold random values, not zeros.
"""
import math

import pytest
import torch

from dsquant.runtime.kernels.attention.prefill_tma import TMAPrefillConfig, prefill_tma_attention, supported
from dsquant.runtime.kernels.attention.reference_attention import paged_prefill_reference
from tests.kernels.prefill_cases import prefill_case


def _check(device, dtype, ctx_lens, q_lens, block_size, kv_heads, group, head_dim, config, atol, qkv_fused=False):
    c = prefill_case(device, dtype, ctx_lens, q_lens, block_size, kv_heads, group, head_dim, qkv_fused=qkv_fused,
                     outliers=True)
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full((c.q.shape[0], kv_heads * group, head_dim), float("nan"), dtype=dtype, device=device)
    prefill_tma_attention(c.q, c.key, c.value, c.k_cache, c.v_cache, c.table, c.lens, c.cu, scale, max(q_lens), config,
                          out=out)
    ref = paged_prefill_reference(c.q.contiguous(), c.k_cache, c.v_cache, c.table, c.cu, c.lens, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0)
    assert (out.float() - ref).norm() <= 1e-2 * ref.norm()


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_tma_cpu(group, pipeline, device):
    ctx_lens = [0, 0, 16, 37, 5]
    q_lens = [1, 19, 32, 1, 27]  # 3rd: context ends on a tile boundary; 4th: one token, long context
    config = TMAPrefillConfig(block_m=16, block_n=8, num_stages=1, num_warps=4, pipeline=pipeline)
    _check(device, torch.float16, ctx_lens, q_lens, 16, 2, group, 32, config, atol=2e-3, qkv_fused=group == 4)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [TMAPrefillConfig(), TMAPrefillConfig(block_n=128, num_warps=8, num_stages=2),
                                    TMAPrefillConfig(num_warps=8, num_stages=3, pipeline=True),
                                    TMAPrefillConfig(block_m=256, num_warps=8, num_stages=3)])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_tma_gpu(group, config, device):
    ctx_lens = [0, 0, 1024, 3000, 7]
    q_lens = [1, 700, 256, 1, 1500]
    kv_heads = 8 if group < 8 else 4
    _check(device, torch.bfloat16, ctx_lens, q_lens, 16, kv_heads, group, 128, config, atol=2e-2,
           qkv_fused=group == 4)


@pytest.mark.gpu
def test_prefill_tma_supported(device):
    q = torch.randn(8, 4, 128, dtype=torch.bfloat16, device=device)
    kv = torch.randn(8, 2, 128, dtype=torch.bfloat16, device=device)
    cache = torch.randn(2, 16, 2, 128, dtype=torch.bfloat16, device=device)
    assert supported(q, kv, kv, cache) == (torch.cuda.get_device_capability()[0] >= 9)
    assert not supported(q, kv[:, :, :64], kv[:, :, :64], cache)  # head dims differ
    odd = torch.randn(8 * 257, dtype=torch.bfloat16, device=device).as_strided((8, 2, 128), (257, 128, 1))
    assert not supported(q, odd, kv, cache)  # rows of 514 bytes: not 16-byte aligned for TMA
    assert not supported(q, kv, kv, cache.to(torch.float8_e4m3fn))


@pytest.mark.parametrize("max_q_len,max_seq_len,takes_tma", [(4096, 4096, True), (8192, 16383, True),
                                                             (8192, 16384, False), (1, 5000, False)])
def test_runtime_sends_prefix_dominated_steps_to_the_paged_kernel(max_q_len, max_seq_len, takes_tma):
    """attention_triton.new_keys_kwargs: the new keys go to the TMA kernel unless the cached context is at least
    as long as the new tokens (there the paged kernel was faster: 8192 + 8192 at 0.87-0.96x)."""
    from dsquant.runtime.layers.attention import PagedContext
    from dsquant.runtime.layers.attention_triton import new_keys_kwargs

    one = torch.zeros(1)
    ctx = PagedContext(one, one, one, one, one, one, max_q_len=max_q_len, max_seq_len=max_seq_len)
    kv = torch.zeros(2, 1, 16)
    assert bool(new_keys_kwargs(ctx, kv, kv)) == takes_tma
