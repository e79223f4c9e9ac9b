"""`dsquant bench engine --tensor-parallel-size 1,2`: what tensor parallelism buys and what its
collectives cost, on the same random model.

- `allreduce_per_token`: one more batch-1 request with rank 0's all-reduces timed
  (parallel.state.CommTimes: CUDA events around each NCCL call, the host clock under gloo), so
  the figure is the time a decode step spends in its collectives, waiting for the slowest rank
  included, beside that request's own time per token. The request decodes eagerly (its graphs set
  aside; the workers follow rank 0's eager STEPs), since events cannot time the all-reduces inside a
  CUDA graph: with graphs on (parallel.worker.TP_CUDA_GRAPHS), its time per token is the eager one.
- `format_tp_table`: each scheme at TP = N against TP = 1 (batch-1 decode, concurrent throughput,
  the all-reduce share of a token's time).
"""
from __future__ import annotations


def allreduce_per_token(engine, prompts: list[list[int]], run_requests, output_len: int = 32) -> dict:
    """Time the all-reduces of a batch-1 request of `output_len` tokens on a tensor-parallel engine."""
    from dsquant.runtime.parallel.state import CommTimes

    runner = engine.runner
    state, graphs = runner.parallel, runner.graphs
    state.comm_times, runner.graphs = (timer := CommTimes()), None
    try:
        run = run_requests(engine, prompts[:1], output_len)
    finally:
        state.comm_times, runner.graphs = None, graphs
    total_s, tokens = timer.total_s(), run["output_tokens"]
    return {"output_tokens": tokens, "calls": timer.calls, "calls_per_token": timer.calls / tokens,
            "allreduce_ms_per_token": 1e3 * total_s / tokens, "tpot_ms": run["tpot_ms"],
            "wall_ms_per_token": 1e3 * run["wall_s"] / tokens,
            "allreduce_share": total_s / run["wall_s"]}


def format_tp_table(result: dict) -> str:
    """Markdown rows of every "<scheme>-tp<N>" row against the scheme's TP = 1 row (empty without any)."""
    rows = result["schemes"]
    lines = []
    for name, r in rows.items():
        tp = r.get("tensor_parallel_size", 1)
        base = rows.get(r["scheme"].rsplit("-tp", 1)[0], {}) if tp > 1 else None
        if base is None:
            continue
        for mode in result["spec"].get("modes", ("sync",)):
            suffix = "_async" if mode == "async" else ""
            b1, b1_base = r.get("batch1" + suffix, {}), base.get("batch1" + suffix, {})
            c, c_base = r.get("concurrent" + suffix, {}), base.get("concurrent" + suffix, {})
            ar = r.get("allreduce" + suffix, {})
            ratio = (lambda a, ref: f"{a / ref:.2f}x" if a and ref else "-")
            lines.append(f"| {name} | {mode} | {b1.get('tpot_ms') or 0:.3f} | "
                         f"{ratio(b1.get('tpot_ms'), b1_base.get('tpot_ms'))} | {c.get('output_tok_s', 0):.0f} | "
                         f"{ratio(c.get('output_tok_s'), c_base.get('output_tok_s'))} | "
                         f"{ar.get('allreduce_ms_per_token', 0):.3f} ({ar.get('allreduce_share', 0):.0%}) | "
                         f"{ar.get('calls_per_token', 0):.1f} |")
    if not lines:
        return ""
    head = ["| engine | stepping | batch-1 TPOT ms | vs TP=1 | concurrent output tok/s | vs TP=1 | "
            "all-reduce ms per token (share of its time) | all-reduces per token |", "|---|---|---|---|---|---|---|---|"]
    return "\n".join(head + lines)
