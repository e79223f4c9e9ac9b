"""Latency of a model through the serving engine, the same settings for every artifact.

- TTFT: one request with a `ttft_input`-token prompt and one output token, median of repeats.
- TPOT: one request (batch 1), `tpot_output` tokens: (end - first token) / (tokens - 1), median.
- Throughput: B concurrent requests (input `throughput_input`, output `throughput_output`,
  ignore_eos), output tokens per second of wall time, for each B in `batch_sizes`, median of repeats.
Every repeat's value is kept (`*_runs`): the report draws their range and warns when repeats disagree.
Prompts are random token ids drawn from a fixed seed, so every artifact sees the same ones.
Before any timing, every measured shape runs once untimed (a TTFT prompt, a TPOT run, one run per
batch size), so kernel compilation, CUDA-graph capture for each batch size and allocator growth fall
outside the timed repeats; on CUDA a short batch-1 decode then repeats until two runs agree within 5%
(the host's speed settles); Python's garbage collector is off while timing, as timeit does.
`rounds` > 1 (validate): every artifact is measured that many times, interleaved, and each figure is
the median over every round's repeats (merge_rounds), so a slow spell of the machine falls on all
artifacts alike. `split_steps` also records each decode step's host work and GPU time.
The timing loop is runtime/engine/timing.py's `timed_generate`, the one the benchmarks use.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
from dsquant.runtime.fallbacks import kernel_fallbacks
from dsquant.runtime.engine.sequence import SamplingParams
from dsquant.runtime.engine.step_times import StepTimes
from dsquant.runtime.engine.timing import TimedRun, timed_generate


@dataclass
class LatencySpec:
    ttft_input: int = 512
    tpot_output: int = 64
    throughput_input: int = 512
    throughput_output: int = 256
    batch_sizes: tuple[int, ...] = (8, 32, 64)
    repeats: int = 3
    rounds: int = 1  # validate: measure every artifact this many times, interleaved (A B C, A B C, ...)
    split_steps: bool = False  # also record each decode step's host work and GPU time (decode_split)
    num_scheduler_steps: int = 1  # the engine's decode steps per launch (runtime/engine/multi_step.py)

    @staticmethod
    def for_device(device: str) -> "LatencySpec":
        """The issue's sizes on a GPU; smaller outputs on CPU, where figures are labelled CPU."""
        if device == "cuda":
            return LatencySpec()
        return LatencySpec(ttft_input=512, tpot_output=16, throughput_input=128, throughput_output=16,
                           batch_sizes=(8, 32, 64), repeats=2)


@dataclass
class LatencyResult:
    device: str
    spec: dict
    ttft_s: float
    tpot_s: float
    throughput_tok_s: dict[int, float] = field(default_factory=dict)
    ttft_runs: list[float] = field(default_factory=list)  # each repeat, seconds
    tpot_runs: list[float] = field(default_factory=list)
    throughput_runs: dict[int, list[float]] = field(default_factory=dict)  # batch -> each repeat's tok/s
    # split_steps: batch -> medians over its decode steps of wall, host (wall minus the wait for the
    # sampled tokens) and GPU (forward + sampling, CUDA events) time in us (runtime/engine/step_times.py)
    decode_split: dict[int, dict[str, float]] = field(default_factory=dict)
    kernel_fallbacks: list[str] = field(default_factory=list)  # runtime/fallbacks.py, of the timed engine


def merge_rounds(results: list[LatencyResult]) -> LatencyResult:
    """One result from several measurements of the same model (interleaved rounds): every repeat's
    value kept, each figure the median over all of them, decode splits the median of the rounds'."""
    first = results[0]
    ttfts = [x for r in results for x in r.ttft_runs]
    tpots = [x for r in results for x in r.tpot_runs]
    runs = {b: [x for r in results for x in r.throughput_runs.get(b, [])] for b in first.throughput_runs}
    split = {}
    for b in first.decode_split:
        parts = [r.decode_split[b] for r in results if b in r.decode_split]
        split[b] = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    return LatencyResult(first.device, first.spec, statistics.median(ttfts), statistics.median(tpots),
                         {b: statistics.median(v) for b, v in runs.items()}, ttfts, tpots, runs, split,
                         first.kernel_fallbacks)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, length), generator=g).tolist()


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> TimedRun:
    """Run prompts to completion, greedy, ignore_eos: exactly `max_tokens` each."""
    return timed_generate(engine, prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def measure_latency(path: str, device: str, spec: LatencySpec, dtype: torch.dtype | None = None,
                    max_num_seqs: int = 64, kv_cache_dtype: str = "auto",
                    step_times: StepTimes | None = None, tensor_parallel_size: int = 1) -> LatencyResult:
    """`step_times`: record every engine step into it, warm-up included (diagnostics:
    scripts/engine_variance.py); split_steps' decode_split then comes from its timed steps.
    tensor_parallel_size > 1: the engine splits the model over that many processes (stopped after)."""
    longest = max(spec.ttft_input + 1, spec.throughput_input + spec.throughput_output, spec.tpot_output + 9)
    engine = LLMEngine(path, EngineConfig(device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                                          max_model_len=longest + 16, enable_prefix_caching=False,
                                          max_num_batched_tokens=max(2048, spec.ttft_input),
                                          kv_cache_dtype=kv_cache_dtype, num_scheduler_steps=spec.num_scheduler_steps,
                                          tensor_parallel_size=tensor_parallel_size))
    engine.time_steps(step_times)
    fallbacks = kernel_fallbacks(engine.model)
    vocab = engine.model.config.vocab_size
    _run(engine, _prompts(1, spec.ttft_input, vocab, 99), 1)  # warm-up: compile, graphs, allocator
    _run(engine, _prompts(1, 8, vocab, 98), spec.tpot_output)
    for b in spec.batch_sizes:
        _run(engine, _prompts(b, spec.throughput_input, vocab, 97), spec.throughput_output)
    _settle(engine, vocab, device)
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return replace(_timed(engine, spec, vocab, device), kernel_fallbacks=fallbacks)
    finally:
        if was_enabled:
            gc.enable()
        engine.close()
        del engine


def _settle(engine: LLMEngine, vocab: int, device: str, max_s: float = 15.0) -> None:
    """On CUDA, repeat a short batch-1 decode until two runs in a row agree within 5%: a freshly
    started device machine ran all host code up to 2x slower for its first tens of seconds
    (scripts/engine_variance.py, H200 2026-12-02), and a decode step there is mostly host work."""
    if device != "cuda":
        return
    prev, start = None, time.perf_counter()
    while time.perf_counter() - start < max_s:
        tpot = _run(engine, _prompts(1, 8, vocab, 96), 32).requests[0].tpot_s
        if prev is not None and abs(tpot - prev) <= 0.05 * prev:
            return
        prev = tpot


def _timed(engine: LLMEngine, spec: LatencySpec, vocab: int, device: str) -> LatencyResult:
    outer = engine.step_times  # measure_latency's step_times, recording throughout
    times = outer if outer is not None or not spec.split_steps else StepTimes()
    engine.time_steps(times)
    split: dict[int, dict[str, float]] = {}
    ttfts, tpots = [], []
    for r in range(spec.repeats):
        ttfts.append(_run(engine, _prompts(1, spec.ttft_input, vocab, r), 1).ttfts()[0])
        mark = len(times.records) if times is not None else 0  # only the decode runs' steps count
        run = _run(engine, _prompts(1, 8, vocab, 100 + r), spec.tpot_output)
        tpots.append(run.requests[0].tpot_s)
        if spec.split_steps:
            split.setdefault(1, []).append(times.split(1, mark))
    runs: dict[int, list[float]] = {}
    for b in spec.batch_sizes:
        for _ in range(spec.repeats):
            mark = len(times.records) if times is not None else 0
            run = _run(engine, _prompts(b, spec.throughput_input, vocab, 1000 + b), spec.throughput_output)
            last = max(req.finished_at for req in run.requests)
            runs.setdefault(b, []).append(run.output_tokens / (last - run.start))
            if spec.split_steps:
                split.setdefault(b, []).append(times.split(b, mark))
    engine.time_steps(outer)
    medians = {b: {k: statistics.median(p[k] for p in parts) for k in parts[0]}
               for b, parts in ((b, [p for p in ps if p]) for b, ps in split.items()) if parts}
    return LatencyResult(device, asdict(spec), statistics.median(ttfts), statistics.median(tpots),
                         {b: statistics.median(v) for b, v in runs.items()}, ttfts, tpots, runs, medians)
