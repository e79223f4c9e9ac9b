"""Paged KV blocks: reference counts, a free list, and prefix caching by chained block hashes.

A full block's hash covers its tokens and, through the previous block's hash, every token before
it, so equal hashes mean equal prefixes (the tokens are compared as well, against collisions).
Freed blocks keep their hash and stay findable until they are handed out again, oldest-freed
first, so a finished request's prefix serves later ones. Only blocks lying wholly inside the
first num_tokens - 1 prompt tokens are matched: the last prompt token is always computed, since
its logits give the first output token.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from dsquant.runtime.engine.sequence import Sequence


def block_hash(prev_hash: int | None, tokens: list[int]) -> int:
    return hash((prev_hash, tuple(tokens)))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: list[int] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, found in the cache

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(1, self.num_blocks)

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]  # evicted from the prefix cache
        block.hash, block.token_ids, block.ref_count = None, [], 1
        return block_id

    def _hashes(self, seq: Sequence, num_full: int) -> list[int]:
        hashes, prev = [], None
        for i in range(num_full):
            prev = block_hash(prev, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(prev)
        return hashes

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids caching seq's leading full blocks (read-only lookup)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for i, h in enumerate(self._hashes(seq, (seq.num_tokens - 1) // self.block_size)):
            block_id = self.hash_to_block.get(h)
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Start seq's block table from its prefix-cache hits (seq holds no blocks yet)."""
        assert not seq.block_table, f"seq {seq.seq_id} already holds blocks"
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.block_hashes = [self.blocks[b].hash for b in hits]
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += seq.num_cached_tokens

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, extra_free: int = 0) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks + extra_free

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table to hold num_computed_tokens + num_new_tokens tokens."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free())

    def register_full_blocks(self, seq: Sequence, num_known: int | None = None) -> None:
        """After a step: hash the blocks that are now full of computed tokens, for later reuse.
        num_known: only seq's first num_known tokens are known on the host (the rest are
        placeholders of steps in flight, async_step.py), so blocks past them wait."""
        if not self.enable_prefix_caching:
            return
        known = seq.num_computed_tokens if num_known is None else min(seq.num_computed_tokens, num_known)
        num_full = known // self.block_size
        prev = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), num_full):
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            prev = block_hash(prev, tokens)
            seq.block_hashes.append(prev)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = prev, list(tokens)
                self.hash_to_block.setdefault(prev, block.block_id)

    def free_seq(self, seq: Sequence) -> None:
        """Release seq's blocks, last first (so a prefix's tail is evicted before its head)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table, seq.block_hashes = [], []
        seq.num_computed_tokens = 0
