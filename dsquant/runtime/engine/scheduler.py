"""Continuous batching with chunked prefill and preemption by recompute.

Each step gets a token budget (max_num_batched_tokens). Running sequences go first, decodes
before unfinished prefills, one token per decode and the largest chunk that fits per prefill;
then waiting sequences are admitted in arrival order (up to max_num_seqs running), their prompt
minus any prefix-cache hit cut into a chunk that fits. With long_prefill_token_threshold > 0, each
prefill's chunk is capped at that many tokens while another request runs or waits, so a long prompt
neither stalls the streams decoding beside it (a step's time grows with its chunk) nor keeps new
requests out of the budget; a prompt with nothing beside it takes the whole budget (vLLM's flag of
that name caps long prefills always).
When a running sequence needs a block and none is free, the most recently admitted running
sequence is preempted: its blocks are freed and it waits at the head of the queue to be
recomputed (prompt + tokens generated so far).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dsquant.runtime.engine.block_manager import BlockManager
from dsquant.runtime.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    import torch


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # > 0: a prefill chunk beside decodes takes at most this many tokens


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per seq, tokens computed this step
    # async scheduling: the in-flight step's sampled tokens [S] on the device; an input token
    # -(k + 1) (a placeholder, async_step.py) is read from its row k there
    prev_tokens: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 and s.num_uncomputed_tokens == 1 for s, n in zip(self.seqs, self.num_new_tokens))

    def samples(self) -> list[bool]:
        """Whether each seq reaches its last token this step (and so samples a new one)."""
        return [s.num_computed_tokens + n == s.num_tokens for s, n in zip(self.seqs, self.num_new_tokens)]


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_scheduled_tokens = 0  # over all steps (the server's tokens-per-step histogram reads it)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.block_manager.free_seq(seq)
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def _reserve(self, seq: Sequence, n: int, scheduled: list[Sequence]) -> bool:
        """Blocks for n more tokens of a running seq, preempting the youngest others if needed."""
        bm = self.block_manager
        while not bm.can_allocate(seq, n):
            victims = [s for s in self.running if s is not seq and s not in scheduled]
            if not victims:
                return False
            self.preempt(victims[-1])
        bm.allocate(seq, n)
        return True

    def fits_without_preemption(self) -> bool:
        """Whether every running sequence's next step (all its uncomputed tokens, up to the token
        budget) gets its blocks from the free list, so schedule() cannot preempt (an upper bound
        on what it allocates for them; admissions never preempt)."""
        bs, cap, need = self.block_manager.block_size, self.config.max_num_batched_tokens, 0
        for seq in self.running:
            end = seq.num_computed_tokens + min(len(seq.token_ids) - seq.num_computed_tokens, cap)
            need += max(0, -(-end // bs) - len(seq.block_table))
        return need <= self.block_manager.num_free_blocks

    def _chunk_cap(self, budget: int) -> int:
        """Tokens the next prefill chunk may take: the budget left, capped at long_prefill_token_threshold
        while another request is running or waiting."""
        cap = self.config.long_prefill_token_threshold
        if cap > 0 and len(self.running) + len(self.waiting) > 1:
            return min(budget, cap)
        return budget

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch()
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            if budget <= 0 or seq.status is not SequenceStatus.RUNNING:  # preempted meanwhile, or ENDING
                continue
            n = min(seq.num_uncomputed_tokens, self._chunk_cap(budget))
            if n < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
                continue
            if not self._reserve(seq, n, batch.seqs):
                self.preempt(seq)
                continue
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # prompt_logprobs need logits at every prompt position: no prefix-cache hits
            hits = bm.match_prefix(seq) if seq.prompt_logprobs is None else []
            todo = seq.num_tokens - len(hits) * bm.block_size
            n = min(todo, self._chunk_cap(budget))
            if n < todo and not self.config.enable_chunked_prefill:
                break
            # hit blocks sitting in the free list are taken out of it by `admit`
            free_hits = sum(1 for b in hits if bm.blocks[b].ref_count == 0)
            needed = -(-(len(hits) * bm.block_size + n) // bm.block_size) - len(hits)
            if needed + free_hits > bm.num_free_blocks:
                break
            self.waiting.popleft()
            bm.admit(seq, hits)
            bm.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        self.num_scheduled_tokens += self.config.max_num_batched_tokens - budget
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free_seq(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
