"""Inputs of the GQA prefill kernel tests (test_paged_prefill.py, test_prefill_tma.py): a ragged batch whose
new tokens' keys and values are stored into random paged caches with store_kv, as the runtime does."""
from dataclasses import dataclass

import torch

from dsquant.runtime.kernels.attention.kv_store import store_kv
from dsquant.runtime.kernels.attention.reference_attention import make_block_table, slots_for


@dataclass
class PrefillCase:
    q: torch.Tensor  # [Tq, Hq, D]
    key: torch.Tensor  # [Tq, Hkv, D], the new tokens' keys (also stored in k_cache)
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    table: torch.Tensor  # [B, max_blocks] int32
    lens: torch.Tensor  # [B] int32, context + new
    cu: torch.Tensor  # [B + 1] int32


def prefill_case(device, dtype, ctx_lens, q_lens, block_size, kv_heads, group, head_dim, qkv_fused=False,
                 outliers=False) -> PrefillCase:
    """qkv_fused: q, key, value as views of one [Tq, (Hq + 2 Hkv) D] projection output; outliers: every 7th
    new key 6x, so a row's running maximum grows late."""
    gen = torch.Generator().manual_seed(sum(ctx_lens) + block_size * group)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    table = make_block_table(seq_lens, block_size, num_blocks, gen)
    positions = [(b, p) for b, (c, n) in enumerate(zip(ctx_lens, seq_lens)) for p in range(c, n)]
    slots = slots_for(table, positions, block_size).to(device)
    tq, hq = sum(q_lens), kv_heads * group
    if qkv_fused:
        qkv = torch.randn(tq, (hq + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
        q, key, value = qkv.split([hq * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
        q, key, value = (t.view(tq, -1, head_dim) for t in (q, key, value))
    else:
        q = torch.randn(tq, hq, head_dim, dtype=dtype, device=device)
        key = torch.randn(tq, kv_heads, head_dim, dtype=dtype, device=device)
        value = torch.randn_like(key)
    if outliers:
        key[5::7] *= 6.0
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)  # random prefix
    v_cache = torch.randn_like(k_cache)
    store_kv(key, value, k_cache, v_cache, slots)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return PrefillCase(q, key, value, k_cache, v_cache, table.to(device), lens, cu)
