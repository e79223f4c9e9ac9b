"""store_kv / store_latent write each token's row into exactly its slot and nowhere else.

Property: after the store, the cache equals a copy of its previous (random) contents with the
reference scatter applied; slots of -1 are skipped; every block size; GQA and MLA layouts.
"""
import pytest
import torch

from dsquant.errors import DsquantError
from dsquant.runtime.kernels.attention.kv_store import store_kv, store_latent
from dsquant.runtime.kernels.attention.reference_attention import make_block_table, slots_for, store_kv_reference


def _slots(seq_lens, new_tokens, block_size, num_blocks, gen):
    """Slots of the last `new_tokens[b]` positions of each sequence, plus a padding token (-1)."""
    table = make_block_table(seq_lens, block_size, num_blocks, gen)
    positions = [(b, p) for b, n in enumerate(seq_lens) for p in range(n - new_tokens[b], n)]
    slots = slots_for(table, positions, block_size)
    return torch.cat([slots, torch.tensor([-1], dtype=torch.int64)])


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float16])
def test_store_kv_gqa_cpu(block_size, dtype, device):
    _check_store_kv(block_size, dtype, device, kv_heads=2, head_dim=32, num_blocks=12)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_store_kv_gqa_gpu(block_size, device):
    _check_store_kv(block_size, torch.bfloat16, device, kv_heads=8, head_dim=128, num_blocks=512)


def _check_store_kv(block_size, dtype, device, kv_heads, head_dim, num_blocks):
    gen = torch.Generator().manual_seed(block_size)
    seq_lens = [block_size, 3 * block_size + 5, 1, 2 * block_size]  # ends on a block boundary, length 1
    new_tokens = [block_size, 7, 1, 1]  # a prefill chunk, a chunk across blocks, decodes
    slots = _slots(seq_lens, new_tokens, block_size, num_blocks, gen).to(device)
    t = slots.shape[0]
    qkv = torch.randn(t, (4 + 2) * kv_heads * head_dim, dtype=dtype, device=device)  # fused projection output
    key = qkv[:, 4 * kv_heads * head_dim : 5 * kv_heads * head_dim].view(t, kv_heads, head_dim)  # strided view
    value = qkv[:, 5 * kv_heads * head_dim :].view(t, kv_heads, head_dim)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_reference(key, value, k_ref, v_ref, slots)
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("block_size", [16, 64])
def test_store_latent_mla_cpu(block_size, device):
    _check_store_latent(block_size, torch.float16, device, rank=64, rope=16, num_blocks=10)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_store_latent_mla_gpu(block_size, device):
    _check_store_latent(block_size, torch.bfloat16, device, rank=512, rope=64, num_blocks=256)


def _check_store_latent(block_size, dtype, device, rank, rope, num_blocks):
    gen = torch.Generator().manual_seed(7 + block_size)
    seq_lens = [2 * block_size, block_size + 3, 1]
    slots = _slots(seq_lens, [2 * block_size, 4, 1], block_size, num_blocks, gen).to(device)
    t = slots.shape[0]
    kv_c = torch.randn(t, rank, dtype=dtype, device=device)
    k_pe = torch.randn(t, 1, rope, dtype=dtype, device=device)  # [T, 1, P] as DeepSeek's rope output
    cache = torch.randn(num_blocks, block_size, rank + rope, dtype=dtype, device=device)
    ref = cache.clone()
    keep = slots >= 0
    ref.view(-1, rank + rope)[slots[keep]] = torch.cat([kv_c, k_pe[:, 0]], -1)[keep]
    store_latent(kv_c, k_pe, cache, slots)
    assert torch.equal(cache, ref)


def test_store_rejects_int32_slots(device):
    cache = torch.zeros(2, 16, 1, 16, dtype=torch.float16, device=device)
    key = torch.randn(3, 1, 16, dtype=torch.float16, device=device)
    with pytest.raises(DsquantError, match="slot_mapping"):
        store_kv(key, key, cache, cache.clone(), torch.zeros(3, dtype=torch.int32, device=device))
