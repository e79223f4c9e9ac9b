"""tune's outputs, each written to a temporary file and renamed: recipe.yaml, tune.json, tune.md, pareto.png."""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path

import yaml

from dsquant.calibrate.recipe import load_recipe
from dsquant.tune import fusion
from dsquant.tune import latency as lat
from dsquant.tune.fusion import JOINT, choice_of
from dsquant.tune.space import choice_recipe

GB = 1e9


def _write(path: Path, data: str | bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def _choice(ctx, plan) -> dict[str, str]:
    return choice_of(ctx["units"], plan)


def _share_us(ctx, unit_key: str, scheme: str, m: int) -> float:
    """Predicted microseconds of one search unit under `scheme` at m tokens (an experts pair together)."""
    space, table = ctx["space"], ctx["table"]
    if JOINT in scheme:
        shared, routed = fusion.pairs(space)[unit_key.split(":", 1)[0]]
        return fusion.experts_us(space, shared, routed, *scheme.split(JOINT), table, m, lat.unit_us)
    return lat.unit_us(space, next(x for x in space.units if x.key == unit_key), scheme, table, m)


def _predicted(ctx, plan) -> dict:
    choice = _choice(ctx, plan)
    timing = lat.predict(ctx["space"], choice, ctx["table"], ctx["args"].batches)
    return {"kl": plan.kl, "ppl_increase_pct": math.expm1(ctx["c"] * plan.kl) * 100, "weight_gb": plan.bytes / GB,
            "step_us": timing["step_us"], "linear_us": timing["linear_us"], "throughput_tok_s": timing["throughput_tok_s"], "cost": plan.cost}


def _recipe_text(ctx) -> str:
    a, pred = ctx["args"], _predicted(ctx, ctx["chosen"])
    budget = (f"ppl +{a.max_ppl_increase}%" if a.max_ppl_increase is not None else "") + \
             (f" KL {a.max_kl}" if a.max_kl is not None else "") + \
             (f", weights <= {a.max_weight_gb} GB" if a.max_weight_gb is not None else "")
    desc = (f"dsquant tune of {Path(a.model_dir).name}, budget {budget.strip()}: predicted KL {pred['kl']:.4g}, "
            f"ppl +{pred['ppl_increase_pct']:.3g}%, TPOT " + ", ".join(
                f"b{b} {us / 1e3:.3g} ms" for b, us in pred["step_us"].items()))
    raw = choice_recipe(ctx["space"], _choice(ctx, ctx["chosen"]), f"tuned-{Path(a.model_dir).name}", desc)
    return "# Written by dsquant tune (tune.md says how it was chosen).\n" + yaml.safe_dump(raw, sort_keys=False)


def _spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else float("nan")


def _payload(ctx) -> dict:
    a, sens, table = ctx["args"], ctx["sens"], ctx["table"]
    cands = sens.candidates
    return {
        "model": a.model_dir, "device": a.device, "latency_device": table.device, "latency_source": table.source,
        "args": {k: v for k, v in vars(a).items()},
        "budget": {"kl": ctx["budget"], "max_weight_bytes": None if ctx["cap"] == math.inf else ctx["cap"],
                   "ppl_coefficient": ctx["c"], "ppl_coefficient_note": ctx["c_note"]},
        "fixed_bytes": ctx["fixed_bytes"], "fixed_us": table.fixed, "host_us": table.host,
        "chosen": {"choice": _choice(ctx, ctx["chosen"]), "predicted": _predicted(ctx, ctx["chosen"])},
        "uniform": {s: _predicted(ctx, p) for s, p in ctx["uniform"].items()},
        "compared": {n: None if p is None else _predicted(ctx, p) for n, p in ctx.get("compared", {}).items()},
        "front": [{"choice": _choice(ctx, p), **_predicted(ctx, p)} for p in ctx["front"]],
        "search": {"exact": ctx["result"].exact and ctx["everything"].exact, "feasible_front": len(ctx["result"].plans),
                   "notes": ctx["result"].notes},
        "sensitivity": {"heldout_tokens": sens.heldout_tokens, "calib_tokens": sens.calib_tokens,
                        "base_nll": sens.base_nll, "candidates": [asdict(c) for c in cands],
                        "proxy_spearman": _spearman([c.proxy for c in cands], [c.kl for c in cands])
                        if cands else None},
        "latency_notes": table.notes, "proof": ctx["proof"],
    }


def _err(pred: float, meas: float) -> str:
    if not meas or math.isnan(meas):
        return "n/a"
    return f"{(pred - meas) / meas * 100:+.1f}%"


def _anchored(payload, p: dict, bs: list[int]) -> dict | None:
    """p's prediction with the fixed work and host floor re-timed by the proof's own BF16 baseline
    (latency.split_fixed on that run's measured BF16 step and its decode split), p's Linears as
    predicted. The engine's per-step host work moves between runs (process, clocks), and every row
    of one validate run shares it."""
    from dsquant.tune.latency import split_fixed

    base, bf16 = (payload.get("proof") or {}).get("baseline_latency"), payload["uniform"].get("bf16")
    if not base or bf16 is None or "linear_us" not in p or "linear_us" not in bf16:
        return None
    steps = {}
    for b in bs:
        measured = base["tpot_us"] if b == 1 else b / base["throughput_tok_s"].get(b, math.nan) * 1e6
        split = (base.get("decode_split") or {}).get(b)
        fixed, host = split_fixed(measured, split, bf16["linear_us"][b])
        steps[b] = max(host, fixed + p["linear_us"][b])
    return {"step_us": steps, "throughput_tok_s": {b: b / us * 1e6 for b, us in steps.items()}}


def _compared_lines(payload, bs: list[int]) -> list[str]:
    """The chosen recipe against each --compare recipe, predicted and measured in one validate run."""
    proof, pred = payload["proof"], payload["chosen"]["predicted"]
    measured = proof.get("compared") or {}
    if not measured:
        return []

    def cells(p, m) -> str:
        a = _anchored(payload, p, bs) or p
        out = [f"{p['step_us'][1] / 1e3:.3f} / {a['step_us'][1] / 1e3:.3f} / {m['tpot_us'] / 1e3:.3f} "
               f"({_err(p['step_us'][1], m['tpot_us'])}, {_err(a['step_us'][1], m['tpot_us'])})" if 1 in bs else "n/a"]
        for b in (b for b in bs if b > 1):
            got = m["throughput_tok_s"].get(b, float("nan"))
            out.append(f"{p['throughput_tok_s'][b]:.0f} / {a['throughput_tok_s'][b]:.0f} / {got:.0f} "
                       f"({_err(p['throughput_tok_s'][b], got)}, {_err(a['throughput_tok_s'][b], got)})")
        return " | ".join(out)

    heads = (["TPOT b1 ms: predicted / re-anchored / measured (errors)"] if 1 in bs else []) + \
        [f"tok/s b{b}: predicted / re-anchored / measured (errors)" for b in bs if b > 1]
    lines = ["", "## Against the compared recipes (one validate run, same inputs)", "",
             "| recipe | eval ppl +% | eval KL | GB on disk | " + " | ".join(heads) + " |",
             "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in heads) + " |",
             f"| tuned | {proof['eval']['ppl_increase_pct']:.3g} | {proof['eval']['kl']:.4g} | "
             f"{proof['disk_bytes'] / GB:.4f} | {cells(pred, proof['latency'])} |"]
    verdicts = []
    for name, m in measured.items():
        p = payload["compared"].get(name)
        lines.append(f"| {name} | {m['eval']['ppl_increase_pct']:.3g} | {m['eval']['kl']:.4g} | "
                     f"{m['disk_bytes'] / GB:.4f} | " + (cells(p, m["latency"]) if p else "not in the search space")
                     + " |")
        for b in bs:
            mine = proof["latency"]["tpot_us"] if b == 1 else -proof["latency"]["throughput_tok_s"].get(b, math.nan)
            theirs = m["latency"]["tpot_us"] if b == 1 else -m["latency"]["throughput_tok_s"].get(b, math.nan)
            what = "TPOT" if b == 1 else "throughput"
            verdicts.append(f"batch {b}: tuned {'is at least as fast as' if mine <= theirs else 'is SLOWER than'} "
                            f"{name} (measured {what} {abs(mine) / 1e3 if b == 1 else abs(mine):.4g} against "
                            f"{abs(theirs) / 1e3 if b == 1 else abs(theirs):.4g}{' ms' if b == 1 else ' tok/s'})")
    return lines + [""] + [f"- {v}" for v in verdicts]


def _markdown(ctx, payload) -> str:
    a, pred, proof = ctx["args"], payload["chosen"]["predicted"], ctx["proof"]
    bs = a.batches
    lines = [f"# dsquant tune: {Path(a.model_dir).name}", "",
             f"Budget: KL <= {ctx['budget']:.4g} nats/token on {ctx['sens'].heldout_tokens} held-out calibration "
             f"tokens" + (f" (from --max-ppl-increase {a.max_ppl_increase}%: ppl ratio = exp(c KL), {ctx['c_note']})"
                          if a.max_ppl_increase is not None else "")
             + (f"; weights <= {a.max_weight_gb} GB" if a.max_weight_gb is not None else "") + ".",
             f"Latency: {payload['latency_source']} ({payload['latency_device']}); fixed per-step work "
             + ", ".join(f"b{b} {ctx['table'].fixed.get(b, 0) / 1e3:.3g} ms" for b in bs)
             + " (a BF16 decode step from the runtime minus its timed Linears)"
             + ("; host floor " + ", ".join(f"b{b} {ctx['table'].host[b] / 1e3:.3g} ms" for b in bs if b in ctx['table'].host)
                + " (the engine's own work per step: a step costs max(host floor, fixed + Linears))"
                if ctx['table'].host else "") + ".", ""]
    lines += [f"{n}" for n in payload["latency_notes"] + payload["search"]["notes"]]
    lines += ["## Chosen recipe (recipe.yaml)", "", "| unit | scheme | KL | step share b" + str(bs[0]) + " |",
              "| --- | --- | ---: | ---: |"]
    for u, j in zip(ctx["units"], ctx["chosen"].choice):
        o = u.options[j]
        us = _share_us(ctx, u.key, o.scheme, bs[0])
        lines.append(f"| {u.key} | {o.scheme} | {o.kl:.3g} | {us:.1f} us |")
    lines += ["", "## Against uniform recipes (predicted)", "",
              "| recipe | KL | ppl +% | GB | " + " | ".join(f"step b{b} ms | tok/s b{b}" for b in bs) + " |",
              "| --- | ---: | ---: | ---: | " + " | ".join("---: | ---:" for _ in bs) + " |"]
    for name, p in [("tuned", pred)] + [(f"{s} everywhere", v) for s, v in payload["uniform"].items()]:
        lines.append(f"| {name} | {p['kl']:.4g} | {p['ppl_increase_pct']:.3g} | {p['weight_gb']:.4f} | "
                     + " | ".join(f"{p['step_us'][b] / 1e3:.3f} | {p['throughput_tok_s'][b]:.0f}" for b in bs) + " |")
    lines += ["", "## Predicted against measured", ""]
    if proof is None:
        lines += ["Not run (--no-proof)."]
    else:
        h, e, m = proof["heldout"], proof["eval"], proof["latency"]
        rows = [("KL, held-out calibration tokens (additive-KL check)", pred["kl"], h["kl"], ".4g"),
                ("ppl +%, held-out calibration tokens", pred["ppl_increase_pct"], h["ppl_increase_pct"], ".3g"),
                (f"KL, eval sets ({', '.join(e['sets'])})", pred["kl"], e["kl"], ".4g"),
                ("ppl +%, eval sets (mean)", pred["ppl_increase_pct"], e["ppl_increase_pct"], ".3g"),
                ("TPOT batch 1, ms", pred["step_us"].get(1, float("nan")) / 1e3, m["tpot_us"] / 1e3, ".3f")]
        rows += [(f"throughput batch {b}, tok/s", pred["throughput_tok_s"][b],
                  m["throughput_tok_s"].get(b, float("nan")), ".0f") for b in bs if b > 1]
        anch = _anchored(payload, pred, bs)
        if anch is not None:
            rows += [("TPOT batch 1, ms, fixed work re-timed by this run's BF16 baseline",
                      anch["step_us"].get(1, float("nan")) / 1e3, m["tpot_us"] / 1e3, ".3f")] if 1 in bs else []
            rows += [(f"throughput batch {b}, tok/s, fixed work re-timed likewise", anch["throughput_tok_s"][b],
                      m["throughput_tok_s"].get(b, float("nan")), ".0f") for b in bs if b > 1]
        rows.append(("weights GB (predicted) / artifact on disk GB", pred["weight_gb"], proof["disk_bytes"] / GB,
                     ".4f"))
        lines += ["| quantity | predicted | measured | error |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {q} | {p:{f}} | {v:{f}} | {_err(p, v)} |" for q, p, v, f in rows]
        kept = []
        if a.max_ppl_increase is not None:
            ok = e["ppl_increase_pct"] <= a.max_ppl_increase
            kept.append(f"ppl +{e['ppl_increase_pct']:.3g}% on the eval sets against --max-ppl-increase "
                        f"{a.max_ppl_increase}%: {'kept' if ok else 'NOT kept'}")
        if a.max_kl is not None:
            kept.append(f"held-out KL {h['kl']:.4g} against --max-kl {a.max_kl}: "
                        f"{'kept' if h['kl'] <= a.max_kl else 'NOT kept'}")
        lines += [""] + [f"- {k}" for k in kept] + [
            f"- artifact {proof['artifact']} ({proof['format']}); validate report {proof['validate_report']}",
            "- measured latency: dsquant's engine (validate), same LatencySpec as the fixed-work timing"]
        lines += [f"- runtime fallback (slower than the table priced): {f}"
                  for f in proof["latency"].get("kernel_fallbacks", [])]
        lines += _compared_lines(payload, bs)
    cands = ctx["sens"].candidates
    lines += ["", "## Sensitivity (each candidate alone, held-out calibration tokens)", "",
              f"Layer-local proxy (relative squared error of the layer output) against the real KL: Spearman rank "
              f"correlation {payload['sensitivity']['proxy_spearman']:.3f} over {len(cands)} candidates.", "",
              "| layer | group | scheme | KL | NLL change | proxy |", "| ---: | --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {c.layer} | {c.group} | {c.scheme} | {c.kl:.3g} | {c.dnll:+.3g} | {c.proxy:.3g} |" for c in cands]
    return "\n".join(lines) + "\n"


def _plot(ctx, payload, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bs = ctx["args"].batches
    panels = [("step", bs[0])] + [("tput", b) for b in bs[1:]]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)

    def x_of(p, kind, b):
        return p["step_us"][b] / 1e3 if kind == "step" else p["throughput_tok_s"][b]

    cloud = [_predicted(ctx, p) for p in ctx["random"]]
    for ax, (kind, b) in zip(axes[0], panels):
        ax.scatter([x_of(p, kind, b) for p in cloud], [p["kl"] for p in cloud], s=6, c="0.7", label="candidates")
        front = payload["front"]
        ax.scatter([x_of(p, kind, b) for p in front], [p["kl"] for p in front], s=10, c="tab:blue")
        ax.plot([x_of(p, kind, b) for p in front], [p["kl"] for p in front], c="tab:blue", lw=1, label="front")
        for name, p in payload["uniform"].items():
            ax.scatter([x_of(p, kind, b)], [p["kl"]], marker="s", s=30, label=f"{name} everywhere")
        for name, p in payload["compared"].items():
            if p is not None:
                ax.scatter([x_of(p, kind, b)], [p["kl"]], marker="D", s=40, facecolors="none", edgecolors="k",
                           label=f"{name} (recipe)")
        chosen = payload["chosen"]["predicted"]
        ax.scatter([x_of(chosen, kind, b)], [chosen["kl"]], marker="*", s=200, c="red", label="chosen", zorder=5)
        ax.axhline(ctx["budget"], ls="--", c="red", lw=0.8, label="KL budget")
        ax.set_xlabel(f"predicted TPOT batch {b} (ms)" if kind == "step" else f"predicted throughput batch {b} (tok/s)")
        ax.set_ylabel("predicted KL (nats/token, held-out)")
        ax.set_title(f"{Path(ctx['args'].model_dir).name}: {payload['latency_device']}", fontsize=9)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write_outputs(ctx, recipe_only: bool = False):
    """recipe.yaml (loaded back to prove quantize accepts it); then tune.json, tune.md, pareto.png."""
    out = Path(ctx["args"].out_dir)
    recipe_path = out / "recipe.yaml"
    _write(recipe_path, _recipe_text(ctx))
    load_recipe(str(recipe_path))
    if recipe_only:
        return recipe_path
    payload = _payload(ctx)
    _write(out / "tune.json", json.dumps(payload, indent=1, default=str))
    _write(out / "tune.md", _markdown(ctx, payload))
    _plot(ctx, payload, out / "pareto.png")
    return payload
