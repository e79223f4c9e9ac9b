"""A request's state in the engine: its tokens, how many are in the KV cache, its blocks."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

from dsquant.errors import DsquantError


@dataclass
class SamplingParams:
    """temperature 0 = greedy; top_k <= 0 and top_p = 1 switch those filters off.

    logprobs = N records each generated token's log-probability and the N most likely ones;
    prompt_logprobs = N does the same for every prompt token after the first (such a request
    skips the prefix cache, since cached positions are never run through the model).

    Penalties (vLLM's semantics, see penalties.py): presence_penalty and frequency_penalty
    subtract from the logits of tokens generated so far (once, and once per occurrence);
    repetition_penalty > 1 discourages tokens of the prompt or the output (positive logits
    divided by it, negative ones multiplied); logit_bias {token id: bias} is added to the
    logits. The defaults (0, 0, 1, None) switch them off and cost nothing.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens <= 0:
            raise DsquantError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.temperature < 0:
            raise DsquantError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DsquantError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise DsquantError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise DsquantError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def has_penalties(self) -> bool:
        """Whether any of presence/frequency/repetition penalty or logit_bias is on."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    ENDING = "ending"  # running, but its in-flight token ends it by length: never scheduled again
    FINISHED = "finished"


class Sequence:
    """One request. token_ids = prompt + generated; the first num_computed_tokens are cached.

    Under async scheduling (async_step.py) the last token or two may be placeholders -(k + 1):
    tokens sampled on the device but not read yet (row k of their step's sampled tokens).
    """

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float = 0.0):
        self.seq_id, self.request_id = seq_id, request_id
        self.token_ids = list(prompt_token_ids)
        self.prompt_token_ids = list(prompt_token_ids)  # one list shared by every RequestOutput
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, found by prefix caching at admission
        self.block_table: list[int] = []  # grows by append; free_seq replaces it (block_table_array relies on both)
        self._table_list: list[int] | None = None  # the list _table_array mirrors the first _table_len entries of
        self._table_array = np.zeros(0, dtype=np.int32)
        self._table_len = 0
        self.block_hashes: list[int] = []  # hash of each full block registered so far
        self.finish_reason: str | None = None
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None  # per-request RNG when params.seed is set
        # per token (prompt position or completion index): (logprob, {token id: logprob} of the top N)
        self.prompt_logprobs: list[tuple[float, dict] | None] | None = (
            [None] * self.num_prompt_tokens if params.prompt_logprobs is not None else None)
        self.logprobs: list[tuple[float, dict]] | None = [] if params.logprobs is not None else None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def ends_by_length(self, num_tokens: int, max_model_len: int) -> bool:
        """Whether holding num_tokens tokens (prompt included) reaches max_tokens or max_model_len."""
        return num_tokens - self.num_prompt_tokens >= self.params.max_tokens or num_tokens >= max_model_len

    def num_blocks_for(self, num_tokens: int, block_size: int) -> int:
        return -(-num_tokens // block_size)

    def block_table_array(self) -> np.ndarray:
        """block_table as int32 [len] (a view of a buffer reused across steps), converted
        incrementally: only the blocks appended since the last call, so staging a step's block
        tables costs the same at any context length."""
        table, n = self.block_table, self._table_len
        if table is not self._table_list:  # free_seq gave the sequence a new (empty) list
            self._table_list, n = table, 0
        m = len(table)
        if m > n:
            if self._table_array.shape[0] < m:
                grown = np.zeros(max(m, 2 * self._table_array.shape[0], 16), dtype=np.int32)
                grown[:n] = self._table_array[:n]
                self._table_array = grown
            self._table_array[n:m] = table[n:m]
        self._table_len = m
        return self._table_array[:m]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
