"""The latency half of the validate report: ranges over repeats, error bars and disagreement warnings.

Each latency figure is the median over `spec.repeats` runs; its range is [min, max] over those
runs (a single run has none). Repeats that spread by more than SPREAD_TOLERANCE of their median,
or a throughput that falls steeply as the batch grows, make the figures (and the plot's Pareto
front) untrustworthy: the report and stderr say so.
"""
from __future__ import annotations

import statistics

SPREAD_TOLERANCE = 0.25  # (max - min) / median over repeats beyond which repeats "disagree"
FALLING_THROUGHPUT = 0.5  # tok/s at a larger batch below this fraction of a smaller batch's


def run_range(runs: list[float] | None) -> tuple[float, float] | None:
    """(min, max) over repeats; None with fewer than two."""
    if not runs or len(runs) < 2:
        return None
    return min(runs), max(runs)


def fmt_runs(value: float, runs: list[float] | None, scale: float, digits: int) -> str:
    """'value [min, max]' with the repeats' range, or just the value for a single run."""
    rng = run_range(runs)
    text = f"{value * scale:.{digits}f}"
    return text if rng is None else f"{text} [{rng[0] * scale:.{digits}f}, {rng[1] * scale:.{digits}f}]"


def largest_batch(latency: dict) -> str | int:
    return max(latency["throughput_tok_s"], key=lambda b: int(b))


def throughput_runs(latency: dict) -> list[float]:
    """The repeats' tok/s at the largest batch (JSON keys may be strings)."""
    runs = latency.get("throughput_runs") or {}
    b = largest_batch(latency)
    return runs.get(b) or runs.get(str(b)) or runs.get(int(b)) or []


def _spread(runs: list[float]) -> float:
    med = statistics.median(runs)
    return (max(runs) - min(runs)) / med if med > 0 else 0.0


def latency_warnings(rows) -> list[str]:
    """One line per row and figure whose repeats disagree or whose throughput falls with batch."""
    out = []
    for r in rows:
        lat = r.latency
        if not lat:
            continue
        figures = [("TTFT", lat.get("ttft_runs"), 1e3, "ms"), ("TPOT", lat.get("tpot_runs"), 1e3, "ms")]
        figures += [(f"tok/s @ batch {b}", runs, 1.0, "")
                    for b, runs in sorted((lat.get("throughput_runs") or {}).items(), key=lambda kv: int(kv[0]))]
        for label, runs, scale, unit in figures:
            if runs and len(runs) >= 2 and _spread(runs) > SPREAD_TOLERANCE:
                vals = ", ".join(f"{v * scale:.3g}" for v in runs)
                out.append(f"{r.name}: {label} repeats disagree ({vals}{' ' + unit if unit else ''}; spread "
                           f"{100 * _spread(runs):.0f}% of the median): the machine was not quiet, treat its "
                           f"latency and the Pareto front as unreliable")
        tp = sorted(((int(b), v) for b, v in lat["throughput_tok_s"].items()))
        for (b1, v1), (b2, v2) in zip(tp, tp[1:]):
            if v1 > 0 and v2 < FALLING_THROUGHPUT * v1:
                out.append(f"{r.name}: throughput falls from {v1:.0f} tok/s at batch {b1} to {v2:.0f} at batch "
                           f"{b2}: a larger batch should not be slower; check for memory pressure or contention")
    return out


def ppl_increase_range(row, baseline, sets: list[str]) -> tuple[float, float] | None:
    """(low, high) of the perplexity increase in %, from the row's 95% perplexity interval per set
    against the baseline's value, averaged over sets like `ppl_increase_pct`; None without one."""
    if baseline is None or not row.accuracy or not baseline.accuracy or row is baseline:
        return None
    lows, highs = [], []
    for s in sets:
        iv, base = row.accuracy[s]["perplexity"], baseline.accuracy[s]["perplexity"]["value"]
        if iv.get("windows", 2) < 2 or iv["low"] == iv["high"]:
            return None
        lows.append(iv["low"] / base - 1)
        highs.append(iv["high"] / base - 1)
    return 100 * sum(lows) / len(lows), 100 * sum(highs) / len(highs)


def plot_caption(rows, sets: list[str], spec: dict | None) -> str:
    """What each axis averages and what its error bars are."""
    lat = next((r.latency for r in rows if r.latency), None)
    repeats = (spec or {}).get("repeats") or (len(throughput_runs(lat)) if lat else 1)
    b = largest_batch(lat) if lat else "?"
    out_tok = (spec or {}).get("throughput_output", "?")
    x = (f"x: output tokens/s of {b} concurrent requests ({out_tok} output tokens each), median of "
         f"{repeats} repeat{'s' if repeats != 1 else ''}" + ("; bars: min-max over repeats" if repeats > 1 else
                                                             "; one repeat, no bars"))
    y = (f"y: perplexity increase over the baseline, mean over sets ({', '.join(sets)}) of the "
         f"token-weighted perplexity over windows; bars: 95% interval over windows")
    return x + "\n" + y
