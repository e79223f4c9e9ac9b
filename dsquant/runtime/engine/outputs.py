"""What LLMEngine.step returns: one RequestOutput per request that advanced, its text built when read.

A step's host work must not grow with anything but the step's own tokens, so an output holds references,
not copies: its cumulative token ids, text and logprobs (`Cumulative`) are sliced from the sequence and the
detokenizer when first read, and, for a request without stop strings, even its delta text (`LazyDelta`):
then no stop check needs the text at each step, so the engine only hands the tokens to the detokenizer
(IncrementalDetokenizer.defer) and the text is decoded when a reader asks for it: the streaming server
on its HTTP thread, LLM.generate once at the end, and a benchmark or validate run, which reads no text,
never. At 64 sequences and 8 decode steps a launch that took a token's post-processing from 4.1-5.4 us
to 1.9-2.4 us (this project's 2-core CPU, `scripts/detok_cost.py`). vLLM, likewise, detokenizes outside
its engine core.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dsquant.runtime.engine.detokenizer import IncrementalDetokenizer
from dsquant.runtime.engine.sequence import Sequence


class LazyDelta:
    """The text of a lazy detokenizer's tokens [start, end) (token counts), decoded on first read."""

    __slots__ = ("detok", "start", "end", "_text")

    def __init__(self, detok: IncrementalDetokenizer, start: int, end: int):
        self.detok, self.start, self.end = detok, start, end
        self._text: str | None = None

    def text(self) -> str:
        if self._text is None:
            self._text = self.detok.delta(self.start, self.end)
        return self._text


@dataclass
class RequestOutput:
    """One request's progress after a step. new_token_ids and delta_text are this step's;
    token_ids, text and logprobs are cumulative and built when first read (`Cumulative`), so a
    step's host work does not grow with the length of every output (copying them at each step
    made a 64-sequence step at 4000 output tokens cost 4x the step at 100)."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    delta: str | LazyDelta = field(default="", repr=False)  # read it as delta_text
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # when SamplingParams asked: per prompt token (None for the first), (logprob, {token id: logprob} of the top N)
    prompt_logprobs: list | None = None
    cumulative: "Cumulative | None" = field(default=None, repr=False, compare=False)

    @property
    def delta_text(self) -> str:
        """The text this step's tokens added."""
        return self.delta if isinstance(self.delta, str) else self.delta.text()

    @property
    def token_ids(self) -> list[int]:
        """Every completion token so far."""
        return self.cumulative.token_ids() if self.cumulative is not None else list(self.new_token_ids)

    @property
    def text(self) -> str:
        return self.cumulative.text() if self.cumulative is not None else self.delta_text

    @property
    def logprobs(self) -> list | None:
        """When SamplingParams asked: per completion token, (logprob, {token id: logprob} of the top N)."""
        return self.cumulative.logprobs() if self.cumulative is not None else None


class Cumulative:
    """A RequestOutput's cumulative fields as they were at its step: the sequence's completion
    tokens [num_prompt, end), its text as it was then and its first lp_len logprobs; each built
    once, when read. The text is the first text_len characters (eager detokenizer), the text of
    the first text_mark tokens (lazy one), or, with both None (the last output), the whole text,
    cut at a stop string. The sources only grow past these bounds afterwards, so a late read gives
    what an eager copy would have."""

    __slots__ = ("seq", "end", "detok", "text_len", "text_mark", "lp_len", "_token_ids", "_text")

    def __init__(self, seq: Sequence, end: int, detok: IncrementalDetokenizer | None, text_len: int | None,
                 text_mark: int | None = None):
        self.seq, self.end, self.detok, self.text_len, self.text_mark = seq, end, detok, text_len, text_mark
        self.lp_len = None if seq.logprobs is None else len(seq.logprobs)
        self._token_ids: list[int] | None = None
        self._text: str | None = None

    def token_ids(self) -> list[int]:
        if self._token_ids is None:
            self._token_ids = self.seq.token_ids[self.seq.num_prompt_tokens:self.end]
        return self._token_ids

    def text(self) -> str:
        if self._text is None:
            d = self.detok
            if d is None:
                self._text = ""
            elif self.text_mark is not None:
                self._text = d.text_upto(d.length_at(self.text_mark))
            else:
                self._text = d.text if self.text_len is None else d.text_upto(self.text_len)
        return self._text

    def logprobs(self) -> list | None:
        lp = self.seq.logprobs
        return None if lp is None else lp[:self.lp_len]
