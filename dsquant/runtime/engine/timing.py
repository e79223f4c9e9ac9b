"""Timed generation: add prompts to an idle engine, step until all finish, record when each token came.

The one loop that validate/latency.py (TTFT, TPOT, throughput) and the benchmarks (bench/engine.py,
bench/serve_local.py's offline peer) time the engine with. Times are `time.perf_counter()` seconds:
`start` is taken after waiting for the GPU, before the first `add_request`; a token's time is when
the `engine.step()` that returned it came back (every output of one step shares it); `end` is when
the last step came back. Nothing but the stepping runs inside the loop (the KV blocks in use are
read once per step), so the figures mean the same for every caller:
  - time to first token of request i: `requests[i].token_times[0] - start`;
  - time per output token after the first: gaps between `token_times`, or
    `(finished_at - token_times[0]) / (tokens - 1)`;
  - output tokens per second of wall time: `output_tokens / wall_s`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class RequestTimes:
    """One request of a timed run, in the order its prompt was given."""

    request_id: str
    prompt_tokens: int = 0  # set when it finishes
    token_times: list[float] = field(default_factory=list)  # one per output token
    finished_at: float | None = None

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def tpot_s(self) -> float:
        """Mean seconds per output token after the first, (finished_at - first token) / (tokens - 1):
        also right when several tokens arrive at once (multi-step bursts), where gaps are zero."""
        return (self.finished_at - self.token_times[0]) / max(self.output_tokens - 1, 1)


@dataclass
class TimedRun:
    start: float
    end: float
    requests: list[RequestTimes]
    peak_kv_blocks: int  # most KV-cache blocks in use after any step

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    @property
    def input_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    def ttfts(self) -> list[float]:
        """Seconds from start to each request's first output token."""
        return [r.token_times[0] - self.start for r in self.requests]

    def token_gaps(self) -> list[float]:
        """Seconds between consecutive output tokens of the same request, over every request."""
        return [b - a for r in self.requests for a, b in zip(r.token_times, r.token_times[1:])]


def sync(device) -> None:
    """Wait for the GPU when `device` is a CUDA one (timing boundaries); nothing on CPU."""
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed_generate(engine, prompts: list, params, request_ids: list[str] | None = None) -> TimedRun:
    """Add every prompt (token ids or text) with `params`, step `engine` until all finish.

    `engine` must be idle: every unfinished request would be stepped, and timed, with these.
    """
    sync(engine.device)
    start = time.perf_counter()
    ids = [engine.add_request(p, params, request_id=request_ids[k] if request_ids else None)
           for k, p in enumerate(prompts)]
    runs = {i: RequestTimes(i) for i in ids}
    bm = engine.block_manager
    peak = 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
        for o in outs:
            r = runs[o.request_id]
            r.token_times.extend([now] * len(o.new_token_ids))
            if o.finished:
                r.finished_at, r.prompt_tokens = now, len(o.prompt_token_ids)
    end = time.perf_counter()
    return TimedRun(start, end, [runs[i] for i in ids], peak)
