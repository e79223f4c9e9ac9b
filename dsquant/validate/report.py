"""The validate report: a terminal table, report.md, report.json and accuracy_vs_latency.png.

The plot puts each artifact and the baseline at (output tokens/s at the largest batch,
perplexity increase over the baseline in %) and marks the Pareto front: the points no other
point beats on both speed and accuracy, with error bars (the latency repeats' range, the
perplexity's 95% interval over windows) and a caption saying what each axis averages.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsquant.validate.latency_report import (fmt_runs, latency_warnings, plot_caption, ppl_increase_range,
                                             run_range, throughput_runs)


@dataclass
class ArtifactRow:
    name: str
    path: str
    method: str
    disk_bytes: int
    accuracy: dict  # set name -> SetAccuracy as dict
    latency: dict | None  # LatencyResult as dict
    ppl_increase_pct: float = 0.0  # mean over sets of the perplexity increase
    failed_gate: bool = False
    notes: list[str] = field(default_factory=list)
    lm_eval: dict = field(default_factory=dict)  # task -> [{metric, value, stderr}]
    kv_cache_dtype: str = "auto"  # the KV cache the row ran with (--kv-cache-dtype)
    compared_to: str | None = None  # None: the baseline; else what KL / top-1 / ppl +% are measured against


def throughput(row: ArtifactRow) -> float | None:
    if not row.latency or not row.latency["throughput_tok_s"]:
        return None
    tp = row.latency["throughput_tok_s"]
    return float(tp[max(tp, key=lambda b: int(b))])


def pareto(rows: list[ArtifactRow]) -> set[str]:
    """Names of rows not dominated in (higher throughput, lower perplexity increase)."""
    pts = [(r.name, throughput(r), r.ppl_increase_pct) for r in rows if throughput(r) is not None]
    front = set()
    for name, tp, inc in pts:
        if not any(t2 >= tp and i2 <= inc and (t2 > tp or i2 < inc) for n2, t2, i2 in pts if n2 != name):
            front.add(name)
    return front


def _fmt_iv(iv: dict | None, digits: int = 3) -> str:
    if not iv:
        return "-"
    if iv.get("windows") == 1:
        return f"{iv['value']:.{digits}f} (one window: no interval)"
    if iv.get("windows") is None and iv["low"] == iv["high"]:  # a report.json from before `windows`
        return f"{iv['value']:.{digits}f} (no interval)"
    return f"{iv['value']:.{digits}f} [{iv['low']:.{digits}f}, {iv['high']:.{digits}f}]"


def table(rows: list[ArtifactRow], sets: list[str]) -> str:
    head = ["artifact", "method", "size"] + [f"ppl {s}" for s in sets] + \
           ["ppl +%", "KL mean", "KL p99", "top-1", "TTFT ms", "TPOT ms", "tok/s"]
    lines = [head]
    for r in rows:
        if not r.accuracy:  # a peer that failed: its note says why
            lines.append([r.name, r.method, "-"] + ["-"] * (len(head) - 3))
            continue
        acc = [r.accuracy[s] for s in sets]
        first = acc[0]
        lat = r.latency or {}
        tp = throughput(r)
        size = f"{r.disk_bytes / 1e6:.1f}MB" if r.disk_bytes else "-"
        lines.append([r.name + (" !" if r.failed_gate else ""), r.method, size]
                     + [f"{a['perplexity']['value']:.3f}" for a in acc]
                     + [f"{r.ppl_increase_pct:+.2f}",
                        f"{first['kl_mean']['value']:.4f}" if first.get("kl_mean") else "-",
                        f"{first['kl_p99']:.4f}" if first.get("kl_p99") is not None else "-",
                        f"{first['top1_agreement']['value']:.3f}" if first.get("top1_agreement") else "-",
                        f"{lat['ttft_s'] * 1e3:.1f}" if lat else "-",
                        f"{lat['tpot_s'] * 1e3:.2f}" if lat else "-",
                        f"{tp:.0f}" if tp else "-"])
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in lines)


def lm_eval_table(rows: list[ArtifactRow], markdown: bool = False) -> str:
    """One line per row, one column per lm-eval task metric: "value ±stderr"; "" without scores."""
    cols = list(dict.fromkeys((t, m["metric"]) for r in rows for t, ms in r.lm_eval.items() for m in ms))
    if not cols:
        return ""
    lines = [["artifact"] + [f"{t} {m}" for t, m in cols]]
    for r in rows:
        got = {(t, m["metric"]): m for t, ms in r.lm_eval.items() for m in ms}
        lines.append([r.name] + [_fmt_score(got.get(c)) for c in cols])
    if markdown:
        out = ["| " + " | ".join(lines[0]) + " |", "|" + " --- |" * len(lines[0])]
        return "\n".join(out + ["| " + " | ".join(row) + " |" for row in lines[1:]])
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in lines)


def _fmt_score(m: dict | None) -> str:
    if m is None:
        return "-"
    return f"{m['value']:.4g}" + (f" ±{m['stderr']:.2g}" if m.get("stderr") is not None else "")


def _markdown(rows: list[ArtifactRow], sets: list[str], meta: dict) -> str:
    out = ["# dsquant validate report", "",
           f"Baseline `{meta['baseline']}`; device {meta['device_label']}; {meta['date']}.", "",
           f"KV cache of the artifacts: {meta.get('kv_cache_dtype', 'auto')} (the baseline's: its model dtype)."
           + (" A row `NAME [KV ... vs ...]` is the artifact against itself with the model-dtype cache: what the "
              "cache alone costs." if any(r.compared_to for r in rows) else ""), "",
           "## Accuracy (95% intervals over windows)", "",
           "| artifact | set | perplexity | KL mean | KL p99 | top-1 agreement |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for s in (sets if r.accuracy else []):
            a = r.accuracy[s]
            out.append(f"| {r.name} | {s} ({a['tokens']} tokens, window {a['window']}, stride {a['stride']}) | "
                       f"{_fmt_iv(a['perplexity'])} | {_fmt_iv(a.get('kl_mean'), 4)} | "
                       f"{a['kl_p99']:.4f} | {_fmt_iv(a.get('top1_agreement'))} |" if a.get("kl_mean") else
                       f"| {r.name} | {s} ({a['tokens']} tokens, window {a['window']}, stride {a['stride']}) | "
                       f"{_fmt_iv(a['perplexity'])} | - | - | - |")
    out += ["", f"## Latency ({meta['device_label']})", ""] + _latency_md(rows, meta)
    if lm_eval_table(rows):
        lm = meta.get("lm_eval", {})
        out += ["", f"## lm-evaluation-harness (lm-eval {lm.get('version', '?')}, {lm.get('model', '')}; "
                f"limit {lm.get('limit') or 'none'}; ± standard error)", "", lm_eval_table(rows, markdown=True)]
    out += ["", "## Summary", "", "```", table(rows, sets), "```", ""]
    notes = [f"- {r.name}: {n}" for r in rows for n in r.notes] + [f"- {n}" for n in meta.get("notes", [])]
    if notes:
        out += ["## Notes", ""] + notes + [""]
    return "\n".join(out)


def _latency_md(rows: list[ArtifactRow], meta: dict) -> list[str]:
    """The latency table (median [min, max] over repeats) and its warnings; "not measured" without."""
    measured = [r for r in rows if r.latency]
    if not measured:
        return ["not measured (--no-latency)."]
    spec = meta["spec"]
    batches = list(measured[0].latency["throughput_tok_s"])
    out = [f"Median over {spec['repeats']} repeat{'s' if spec['repeats'] != 1 else ''}"
           + (", [min, max] over repeats." if spec["repeats"] > 1 else " (one repeat: no range)."), "",
           "| artifact | TTFT (input {0}) ms | TPOT (batch 1) ms | {1} |".format(
               spec["ttft_input"], " | ".join(f"tok/s @ batch {b}" for b in batches)),
           "| --- | --- | --- | " + " | ".join("---" for _ in batches) + " |"]
    for r in measured:
        lat = r.latency
        runs = lat.get("throughput_runs") or {}
        out.append(f"| {r.name} | {fmt_runs(lat['ttft_s'], lat.get('ttft_runs'), 1e3, 1)} | "
                   f"{fmt_runs(lat['tpot_s'], lat.get('tpot_runs'), 1e3, 2)} | "
                   + " | ".join(fmt_runs(v, runs.get(b), 1.0, 0) for b, v in lat["throughput_tok_s"].items()) + " |")
    skipped = [r.name for r in rows if not r.latency and r.accuracy]
    if skipped:
        out += ["", f"Not measured: {', '.join(skipped)} (they do not run in dsquant's engine)."]
    warnings = latency_warnings(rows)
    if warnings:
        out += [""] + [f"> **warning**: {w}" for w in warnings]
    return out


def plot(rows: list[ArtifactRow], path: Path, device_label: str, sets: list[str] | None = None,
         spec: dict | None = None) -> bool:
    """accuracy_vs_latency.png; False if matplotlib is missing or no row has latency."""
    pts = [(r, throughput(r)) for r in rows if throughput(r) is not None]
    if not pts:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    front = pareto(rows)
    sets = sets or list(next(r.accuracy for r in rows if r.accuracy))
    baseline = next((r for r in rows if r.name == "baseline"), None)
    fig, ax = plt.subplots(figsize=(7, 5.2))
    for r, tp in pts:
        color = "tab:red" if r.name in front else "tab:blue"
        rng, yr = run_range(throughput_runs(r.latency)), ppl_increase_range(r, baseline, sets)
        if rng or yr:
            ax.errorbar(tp, r.ppl_increase_pct, fmt="none", ecolor=color, alpha=0.6, capsize=3,
                        xerr=[[tp - rng[0]], [rng[1] - tp]] if rng else None,
                        yerr=[[r.ppl_increase_pct - yr[0]], [yr[1] - r.ppl_increase_pct]] if yr else None)
        ax.scatter(tp, r.ppl_increase_pct, s=60, marker="*" if r.name in front else "o", color=color)
        ax.annotate(r.name, (tp, r.ppl_increase_pct), textcoords="offset points", xytext=(5, 5), fontsize=8)
    fr = sorted([(tp, r.ppl_increase_pct) for r, tp in pts if r.name in front])
    if len(fr) > 1:
        ax.plot([p[0] for p in fr], [p[1] for p in fr], "--", color="tab:red", label="Pareto front")
        ax.legend()
    ax.set_xlabel(f"output tokens/s at the largest batch ({device_label})")
    ax.set_ylabel("perplexity increase over baseline (%)")
    ax.set_title("dsquant: accuracy vs throughput")
    ax.grid(alpha=0.3)
    caption = plot_caption(rows, sets, spec)
    if latency_warnings(rows):
        caption += "\nwarning: latency repeats disagree (see report.md): the front may not hold"
    fig.text(0.01, 0.01, caption, fontsize=6.5, va="bottom", ha="left", wrap=True)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def write_report(rows: list[ArtifactRow], sets: list[str], meta: dict, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"md": out_dir / "report.md", "json": out_dir / "report.json",
             "png": out_dir / "accuracy_vs_latency.png"}
    payload = {"meta": meta, "sets": sets, "pareto_front": sorted(pareto(rows)),
               "latency_warnings": latency_warnings(rows), "rows": [asdict(r) for r in rows]}
    for key, text in (("json", json.dumps(payload, indent=1, default=str)), ("md", _markdown(rows, sets, meta))):
        tmp = paths[key].with_name(paths[key].name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, paths[key])
    if not plot(rows, paths["png"], meta["device_label"], sets, meta.get("spec")):
        paths.pop("png")
    return paths
