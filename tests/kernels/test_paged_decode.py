"""Paged GQA decode attention equals float32 softmax attention over each sequence's paged keys.

Covers ragged batches, sequences ending exactly on a block boundary, context length 1 and many
blocks, every block size, GQA group sizes 1/4/8, one split and several (log-sum-exp merge), and
a padded batch row (seq_len 0 gives zeros). Outputs are poisoned with NaN before each launch.
"""
import math

import pytest
import torch

from dsquant.errors import DsquantError
from dsquant.runtime.kernels.attention.paged_decode import DecodeConfig, paged_decode_attention
from dsquant.runtime.kernels.attention.reference_attention import make_block_table, paged_decode_reference


def _run_case(device, dtype, seq_lens, block_size, kv_heads, group, head_dim, config, atol):
    gen = torch.Generator().manual_seed(sum(seq_lens) + block_size + group)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    table = make_block_table(seq_lens, block_size, num_blocks, gen).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    query = torch.randn(len(seq_lens), kv_heads * group, head_dim, dtype=dtype, device=device)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(query, k_cache, v_cache, table, lens, scale, config=config, out=out)
    ref = paged_decode_reference(query, k_cache, v_cache, table, lens, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0)
    for o, r in zip(out.float(), ref):  # per row, so long contexts' small outputs are held to bf16 precision too
        assert (o - r).norm() <= 1e-2 * r.norm() + 1e-6


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_cpu(block_size, group, splits, device):
    seq_lens = [1, 2 * block_size, 5 * block_size + 3, 37]  # length 1, block boundary, many blocks, ragged
    config = DecodeConfig(block_n=32, num_warps=4, num_stages=1, num_splits=splits)
    _run_case(device, torch.float16, seq_lens, block_size, 2, group, 32, config, atol=2e-3)


def test_paged_decode_heuristic_splits_and_padding_row(device):
    """A long sequence next to a padded row (seq_len 0 -> zeros); splits chosen by the heuristic."""
    seq_lens = [700, 0]
    config = DecodeConfig(block_n=32, num_stages=1)
    gen = torch.Generator().manual_seed(3)
    table = make_block_table(seq_lens, 16, 50, gen).to(device)
    query = torch.randn(2, 4, 32, dtype=torch.float16, device=device)
    k_cache = torch.randn(50, 16, 1, 32, dtype=torch.float16, device=device)
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(query, k_cache, v_cache, table, lens, 0.2, config=config, out=out)
    ref = paged_decode_reference(query[:1], k_cache, v_cache, table[:1], lens[:1], 0.2)
    torch.testing.assert_close(out[:1].float(), ref, atol=2e-3, rtol=0)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_paged_decode_rejects_bad_heads(device):
    query = torch.randn(1, 6, 32, dtype=torch.float16, device=device)
    cache = torch.randn(2, 16, 4, 32, dtype=torch.float16, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(DsquantError, match="query heads"):
        paged_decode_attention(query, cache, cache.clone(), torch.zeros(1, 2, dtype=torch.int32, device=device),
                               lens, 0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_decode_gpu(block_size, group, device):
    seq_lens = [1, 64 * block_size, 4099, 33, 2 * block_size, 9000]
    _run_case(device, torch.bfloat16, seq_lens, block_size, 8 // max(1, group // 4), group, 128,
              DecodeConfig(), atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 7])
def test_paged_decode_gpu_forced_splits(splits, device):
    _run_case(device, torch.bfloat16, [5000, 17, 16], 16, 8, 4, 128, DecodeConfig(num_splits=splits), atol=1e-2)


def test_split_heuristic_fills_the_gpu_only_when_needed():
    """One long sequence is split to fill ~4 waves of 132 SMs; a full batch is not; splits keep >= min_tokens."""
    from dsquant.runtime.kernels.attention.split_kv_merge import choose_num_splits

    assert choose_num_splits(programs=8, max_seq_len=32768, min_tokens=256, sms=132) == 64  # capped
    assert choose_num_splits(programs=256, max_seq_len=4096, min_tokens=256, sms=132) == 3
    assert choose_num_splits(programs=1024, max_seq_len=8192, min_tokens=256, sms=132) == 1
    assert choose_num_splits(programs=32, max_seq_len=4096, min_tokens=512, sms=132) == 8  # 4096 / 512
    assert choose_num_splits(programs=1, max_seq_len=100, min_tokens=256, sms=132) == 1
