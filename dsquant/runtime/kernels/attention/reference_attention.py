"""Pure-torch float32 references for the paged attention kernels (tests and benchmarks only).

Loops over sequences, gathers each one's keys from the paged cache token by token through its
block-table row, and applies plain softmax attention. Slow and obviously right.
"""
from __future__ import annotations

import torch


def gather_paged(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """cache [num_blocks, block_size, ...], block_row [max_blocks] -> the sequence's first `length` tokens [length, ...]."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_row.long()[pos // block_size]  # [length]
    return cache[blocks, pos % block_size]


def store_kv_reference(key, value, k_cache, v_cache, slot_mapping) -> None:
    """What store_kv must do: cache.view(-1, ...)[slot] = row, for every slot >= 0."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep].to(v_cache.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [M, H, Dk], k [L, H, Dk], v [L, H, Dv] (float32), mask [M, L] bool (True = attend) -> [M, H, Dv]."""
    scores = torch.einsum("mhd,lhd->hml", q, k) * scale  # [H, M, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hml,lhd->mhd", scores.softmax(-1), v)


def paged_decode_reference(query, k_cache, v_cache, block_table, seq_lens, scale) -> torch.Tensor:
    """query [B, Hq, D]; caches [num_blocks, block_size, Hkv, D] -> float32 [B, Hq, D] (GQA: head h reads kv head h // (Hq/Hkv))."""
    group = query.shape[1] // k_cache.shape[2]
    out = []
    for b, length in enumerate(seq_lens.tolist()):
        k = gather_paged(k_cache, block_table[b], length).float().repeat_interleave(group, 1)  # [L, Hq, D]
        v = gather_paged(v_cache, block_table[b], length).float().repeat_interleave(group, 1)
        out.append(_attend(query[b : b + 1].float(), k, v, scale)[0])
    return torch.stack(out)


def mla_decode_reference(q_nope, q_pe, kv_cache, block_table, seq_lens, scale) -> torch.Tensor:
    """Absorbed MLA: q_nope [B, H, R], q_pe [B, H, P]; kv_cache [num_blocks, block_size, R + P] -> float32 [B, H, R].

    score = q_nope . c + q_pe . k_pe (the latent c serves as key for all heads and as value).
    """
    rank = q_nope.shape[-1]
    heads = q_nope.shape[1]
    out = []
    for b, length in enumerate(seq_lens.tolist()):
        lat = gather_paged(kv_cache, block_table[b], length).float()  # [L, R + P]
        k = lat.unsqueeze(1).expand(length, heads, lat.shape[-1])  # [L, H, R + P]
        q = torch.cat([q_nope[b], q_pe[b]], -1).float().unsqueeze(0)  # [1, H, R + P]
        out.append(_attend(q, k, k[..., :rank], scale)[0])
    return torch.stack(out)


def paged_prefill_reference(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, scale) -> torch.Tensor:
    """q [Tq, Hq, D] (sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1]); -> float32 [Tq, Hq, D].

    Sequence b has seq_lens[b] tokens in the cache, its last q_len ones being the new queries, so
    query i sits at position seq_len - q_len + i and attends to keys 0 .. that position.
    """
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        q_len = cu[b + 1] - cu[b]
        if q_len == 0:
            continue
        k = gather_paged(k_cache, block_table[b], length).float().repeat_interleave(group, 1)
        v = gather_paged(v_cache, block_table[b], length).float().repeat_interleave(group, 1)
        pos = torch.arange(length - q_len, length, device=q.device)  # [q_len]
        mask = torch.arange(length, device=q.device)[None, :] <= pos[:, None]  # [q_len, L]
        out[cu[b] : cu[b + 1]] = _attend(q[cu[b] : cu[b + 1]].float(), k, v, scale, mask)
    return out


def make_block_table(seq_lens: list[int], block_size: int, num_blocks: int, generator=None) -> torch.Tensor:
    """A block table [B, max_blocks] int32 whose sequences own distinct, randomly scattered blocks (unused entries 0)."""
    need = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(max(need), 1)
    if sum(need) > num_blocks:
        raise ValueError(f"{sum(need)} blocks needed, cache has {num_blocks}")
    perm = torch.randperm(num_blocks, generator=generator)
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start : start + n].int()
        start += n
    return table


def slots_for(block_table: torch.Tensor, positions: list[tuple[int, int]], block_size: int) -> torch.Tensor:
    """Slot of each (sequence, position): block_table[b, pos // block_size] * block_size + pos % block_size, int64."""
    return torch.tensor([int(block_table[b, p // block_size]) * block_size + p % block_size for b, p in positions],
                        dtype=torch.int64)
