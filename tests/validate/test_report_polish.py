"""Report polish: "not measured" latency, one-window intervals, error bars + caption, disagreeing
repeats; and quantize's nested (per-module) progress and its error legend."""
import json

import matplotlib
import pytest

from dsquant.validate.cli_validate import _finish
from dsquant.validate.latency_report import latency_warnings, plot_caption
from dsquant.validate.report import ArtifactRow, write_report

SPEC = {"ttft_input": 16, "tpot_output": 4, "throughput_input": 8, "throughput_output": 4,
        "batch_sizes": [2, 4], "repeats": 3}


def _iv(v, lo, hi, windows):
    return {"value": v, "low": lo, "high": hi, "windows": windows}


def _acc(ppl, windows=8):
    half = 0.0 if windows == 1 else 0.2
    return {"eval_prose": {"tokens": 600, "window": 128, "stride": 64,
                           "perplexity": _iv(ppl, ppl - half, ppl + half, windows),
                           "kl_mean": _iv(0.01, 0.01 - half / 100, 0.01 + half / 100, windows), "kl_p99": 0.05,
                           "top1_agreement": _iv(0.9, 0.9 - half / 10, 0.9 + half / 10, windows)}}


def _lat(ttft_runs, tp_runs):
    return {"device": "cpu", "spec": SPEC, "ttft_s": sorted(ttft_runs)[1], "tpot_s": 0.01,
            "throughput_tok_s": {b: sorted(r)[1] for b, r in tp_runs.items()},
            "ttft_runs": ttft_runs, "tpot_runs": [0.01, 0.0101, 0.0099], "throughput_runs": tp_runs}


def _meta():
    return {"baseline": "base", "device": "cpu", "device_label": "CPU", "date": "2026-01-01", "spec": SPEC}


def test_no_latency_says_not_measured(tmp_path):
    rows = [ArtifactRow("baseline", "", "bf16", 0, _acc(10.0), None), ArtifactRow("a", "", "awq", 0, _acc(10.5), None, 5.0)]
    paths = write_report(rows, ["eval_prose"], _meta(), tmp_path)
    md = paths["md"].read_text()
    assert "not measured (--no-latency)" in md and "TTFT (input" not in md.split("## Summary")[0]
    assert "png" not in paths


def test_one_window_interval_is_not_printed_as_a_range(tmp_path):
    rows = [ArtifactRow("baseline", "", "bf16", 0, _acc(10.0, windows=1), None)]
    md = write_report(rows, ["eval_prose"], _meta(), tmp_path)["md"].read_text()
    assert "10.000 (one window: no interval)" in md and "[10.000, 10.000]" not in md


def test_plot_has_error_bars_and_caption_and_quiet_repeats_do_not_warn(tmp_path, monkeypatch):
    matplotlib.use("Agg")
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    calls, texts = [], []
    real_errorbar, real_text = Axes.errorbar, Figure.text
    monkeypatch.setattr(Axes, "errorbar", lambda self, *a, **k: calls.append(k) or real_errorbar(self, *a, **k))
    monkeypatch.setattr(Figure, "text",
                        lambda self, x, y, s, *a, **k: texts.append(s) or real_text(self, x, y, s, *a, **k))
    quiet = {2: [100.0, 102.0, 101.0], 4: [190.0, 195.0, 192.0]}
    rows = [ArtifactRow("baseline", "", "bf16", 0, _acc(10.0), _lat([0.10, 0.11, 0.105], quiet)),
            ArtifactRow("a", "", "awq", 0, _acc(10.5), _lat([0.05, 0.052, 0.051], quiet), 5.0)]
    paths = write_report(rows, ["eval_prose"], _meta(), tmp_path)
    assert paths["png"].stat().st_size > 0
    art = [k for k in calls if k.get("yerr") is not None]
    assert len(calls) == 2 and all(k["xerr"] is not None for k in calls) and len(art) == 1  # baseline: no y bar
    lo, hi = art[0]["yerr"]
    assert lo[0] == pytest.approx(2.0) and hi[0] == pytest.approx(2.0)  # (10.5 +- 0.2) / 10 - 1 = 5 +- 2 %
    caption = texts[0]
    assert "median of 3 repeats" in caption and "min-max over repeats" in caption
    assert "95% interval over windows" in caption and "eval_prose" in caption
    assert plot_caption(rows, ["eval_prose"], SPEC) in caption
    md = paths["md"].read_text()
    assert "| a | 51.0 [50.0, 52.0] |" in md and "warning" not in md
    assert json.loads(paths["json"].read_text())["latency_warnings"] == []


def test_disagreeing_repeats_warn_in_report_and_stderr(tmp_path, capsys):
    noisy = {2: [100.0, 1000.0, 120.0], 4: [40.0, 45.0, 42.0]}  # 10x apart; batch 4 slower than batch 2
    rows = [ArtifactRow("baseline", "", "bf16", 0, _acc(10.0), _lat([0.1, 0.1, 0.1], noisy))]
    warnings = latency_warnings(rows)
    assert any("tok/s @ batch 2 repeats disagree" in w for w in warnings)
    assert any("throughput falls from 120 tok/s at batch 2 to 42 at batch 4" in w for w in warnings)
    paths = write_report(rows, ["eval_prose"], _meta(), tmp_path)
    md = paths["md"].read_text()
    assert "> **warning**: baseline: tok/s @ batch 2 repeats disagree" in md
    _finish(rows, paths)
    err = capsys.readouterr().err
    assert "warning: baseline: tok/s @ batch 2 repeats disagree" in err


def test_quantize_reports_progress_inside_each_layer(tmp_path):
    from dsquant.calibrate.cli_quantize import ERROR_LEGEND, _summary
    from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize
    from tests.tiny_checkpoints import write_tiny_v3

    base = write_tiny_v3(tmp_path / "base")
    ticks = []
    recipe = tmp_path / "awq-fast.yaml"  # a coarse search: the test is about progress, not quality
    recipe.write_text("name: awq-fast\ndefault: {scheme: awq, bits: 4, group_size: 128}\n"
                      "keep: [lm_head, '*.embed_tokens', '*.mlp.gate', '*norm']\n"
                      "awq: {grid: 2, clip: false, block_loss: false}\n")
    report = run_quantize(QuantizeArgs(str(base), str(recipe), str(tmp_path / "awq"), n_samples=2, seqlen=32),
                          module_progress=lambda layer, done, total, what: ticks.append((layer, done, total, what)))
    layers = sorted({t[0] for t in ticks})
    assert layers == list(range(len(report.manifest["layers"])))
    for layer in layers:
        mine = [t for t in ticks if t[0] == layer]
        done = [t[1] for t in mine]  # rising to the total (a batch of experts' scale search counts them all)
        assert done == sorted(set(done)) and done[-1] == mine[0][2] and len(done) > 5
        assert any(t[3] == "awq scales" for t in mine) and any(t[3].endswith("down_proj") for t in mine)
    moe = [t for t in ticks if ".experts." in t[3]]
    assert moe, "an MoE layer ticks once per expert module"
    text = _summary(report)
    assert ERROR_LEGEND in text and "relative output error" in text
