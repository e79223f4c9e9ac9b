"""`dsquant bench engine --long-context N`: one long prompt alone, then beside short decoding streams.

1. warm-up: one prompt of two chunks (max_num_batched_tokens each, prefix included), so the timed
   request's TTFT does not pay the Triton compiles of chunk-sized shapes;
2. alone: the N-token prompt by itself: TTFT (chunked prefill), time per output token at that
   context, KV cache it took;
3. beside streams (issue 23: a long prefill must not stall the decodes running beside it): the
   `streams` short prompts (input_len tokens each) alone, then again with the long prompt added
   after them. Each step the scheduler gives decodes their token first and the long prompt the
   rest of the budget; reported are the short streams' times between tokens while the long prompt
   is prefilling (gaps that end before its first token) against the same streams alone. With
   several long_prefill_thresholds the mixed run repeats once per value (the scheduler's cap on
   the long prompt's chunk while the streams run): `beside_streams` is the first, `beside_by_threshold`
   holds them all.
"""
from __future__ import annotations

import statistics


def _ms(gaps: list[float]) -> dict:
    if not gaps:
        return {"median_ms": None, "p90_ms": None, "gaps": 0}
    s = sorted(gaps)
    return {"median_ms": 1e3 * statistics.median(s), "p90_ms": 1e3 * s[int(0.9 * (len(s) - 1))], "gaps": len(s)}


def long_context_runs(engine, spec, vocab: int, long_len: int, kv_bytes_per_block: int, prompts, run_requests) -> dict:
    """The figures above as one dict (prompts(n, length, seed) draws token ids; run_requests as in engine.py)."""
    from dsquant.runtime.engine.sequence import SamplingParams
    from dsquant.runtime.engine.timing import timed_generate

    chunk = spec.max_num_batched_tokens
    run_requests(engine, prompts(1, min(long_len, 2 * chunk), spec.seed + 3), 2)  # warm-up
    r = run_requests(engine, prompts(1, long_len, spec.seed + 2), 4)
    out = {"prompt_tokens": long_len, "ttft_s": r["ttft_s"], "tpot_ms": r["tpot_ms"],
           "kv_gb": r["peak_kv_blocks"] * kv_bytes_per_block / 1e9, "max_num_batched_tokens": chunk}
    if not spec.long_streams:
        return out
    shorts = prompts(spec.long_streams, spec.input_len, spec.seed + 4)
    sched = engine.scheduler.config
    kept = sched.long_prefill_token_threshold
    runs = []
    try:
        for i, threshold in enumerate(spec.long_prefill_thresholds):
            per_step = min(chunk - spec.long_streams, threshold) if threshold > 0 else chunk - spec.long_streams
            steps = -(-long_len // max(1, per_step)) + 4  # prefill steps, and a few after
            params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
            sched.long_prefill_token_threshold = 0
            alone = timed_generate(engine, shorts, params)
            sched.long_prefill_token_threshold = threshold
            # a fresh long prompt per run: the prefix cache holds the previous one
            mixed = timed_generate(engine, shorts + prompts(1, long_len, spec.seed + 5 + 100 * i), params)
            first = mixed.requests[-1].token_times[0]  # the long prompt's first token: its prefill is done
            during = [b - a for q in mixed.requests[:-1] for a, b in zip(q.token_times, q.token_times[1:])
                      if b <= first]
            runs.append({"streams": spec.long_streams, "stream_input_len": spec.input_len,
                         "long_prefill_token_threshold": threshold, "long_ttft_s": first - mixed.start,
                         "alone": _ms(alone.token_gaps()), "during_prefill": _ms(during)})
    finally:
        sched.long_prefill_token_threshold = kept
    out["beside_streams"] = runs[0]
    out["beside_by_threshold"] = runs
    return out
