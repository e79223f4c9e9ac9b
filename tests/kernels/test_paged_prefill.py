"""Paged causal varlen prefill equals float32 masked attention over each sequence's paged keys.

Each case stores the new tokens' K/V with store_kv first (as the runtime does), then attends from
the new queries to the cached prefix plus themselves: plain prefill (no context), chunked prefill
and prefix hits (context), a single new token after a long context, chunks ending exactly on a
block boundary, every block size, GQA group sizes 1/4/8. Outputs poisoned with NaN.
"""
import math

import pytest
import torch

from dsquant.errors import DsquantError
from dsquant.runtime.kernels.attention.paged_prefill import PrefillConfig, paged_prefill_attention
from dsquant.runtime.kernels.attention.reference_attention import paged_prefill_reference
from tests.kernels.prefill_cases import prefill_case


def _check(device, dtype, ctx_lens, q_lens, block_size, kv_heads, group, head_dim, config, atol):
    c = prefill_case(device, dtype, ctx_lens, q_lens, block_size, kv_heads, group, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full_like(c.q, float("nan"))
    paged_prefill_attention(c.q, c.k_cache, c.v_cache, c.table, c.lens, c.cu, scale, max_q_len=max(q_lens),
                            config=config, out=out)
    ref = paged_prefill_reference(c.q, c.k_cache, c.v_cache, c.table, c.cu, c.lens, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0)
    assert (out.float() - ref).norm() <= 1e-2 * ref.norm()


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_prefill_cpu(block_size, group, device):
    ctx_lens = [0, 0, block_size, 3 * block_size + 1, 5]
    q_lens = [1, 19, block_size, 1, 2 * block_size - 5]  # 3rd ends on a block boundary; 4th: one token, long context
    config = PrefillConfig(block_m=16, block_n=16, num_stages=1)
    _check(device, torch.float16, ctx_lens, q_lens, block_size, 2 if group < 8 else 1, group, 32, config, atol=2e-3)


def test_paged_prefill_rejects_int64_cu_seqlens(device):
    q = torch.randn(4, 2, 16, dtype=torch.float16, device=device)
    cache = torch.randn(1, 16, 2, 16, dtype=torch.float16, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    with pytest.raises(DsquantError, match="cu_seqlens_q"):
        paged_prefill_attention(q, cache, cache.clone(), torch.zeros(1, 1, **i32), torch.full((1,), 4, **i32),
                                torch.tensor([0, 4], dtype=torch.int64, device=device), 0.25)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_prefill_gpu(block_size, group, device):
    ctx_lens = [0, 0, 64 * block_size, 3000, 7]
    q_lens = [1, 700, 4 * block_size, 1, 1500]
    _check(device, torch.bfloat16, ctx_lens, q_lens, block_size, 8 if group < 8 else 4, group, 128,
           PrefillConfig(), atol=2e-2)
