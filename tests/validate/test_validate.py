"""`dsquant validate`: accuracy metrics, latency through the engine, the report and the exit gate.

Runs on a tiny random DeepSeek-V3 checkpoint and its FP8 artifact (CPU), with small latency
sizes; the bundled-model demo is exercised by `dsquant demo` itself.
"""
import json
import subprocess
import sys

import pytest
import torch

from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize
from dsquant.validate.accuracy import compare
from dsquant.validate.latency import LatencySpec
from dsquant.validate.report import ArtifactRow, pareto
from dsquant.validate.runner import ValidateArgs, run_validate
from tests.tiny_checkpoints import write_tiny_v3

SPEC = LatencySpec(ttft_input=16, tpot_output=4, throughput_input=8, throughput_output=4, batch_sizes=(2, 4), repeats=1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("validate")
    base = write_tiny_v3(root / "base")
    art = run_quantize(QuantizeArgs(str(base), "fp8-block", str(root / "fp8"), n_samples=2, seqlen=64)).out_dir
    return base, art


def test_identical_model_has_zero_kl_and_full_agreement(pair):
    from dsquant.models import load_model

    base, _ = pair
    model = load_model(base, dtype=torch.float32)
    tokens = torch.randint(0, 8192, (300,), generator=torch.Generator().manual_seed(0))
    b, res = compare(model, {"same": model}, tokens, "random", 128, 64, "cpu")
    same = res["same"]
    assert same.kl_mean.value == pytest.approx(0, abs=1e-6) and same.top1_agreement.value == 1.0
    assert same.perplexity.value == pytest.approx(b.perplexity.value, rel=1e-9)
    assert b.perplexity.low <= b.perplexity.value <= b.perplexity.high


def test_validate_reports_accuracy_latency_and_gates(pair, tmp_path):
    base, art = pair
    args = ValidateArgs([str(art)], str(base), out_dir=str(tmp_path / "report"), window=128, stride=64,
                        max_eval_tokens=600, latency_spec=SPEC, max_ppl_increase=50.0, peers=False)
    rows, paths = run_validate(args, log=lambda m: None)
    assert [r.name for r in rows] == ["baseline", "fp8"]
    fp8 = rows[1]
    for s in ("eval_prose", "eval_code"):
        acc = fp8.accuracy[s]
        assert 0 < acc["kl_mean"]["value"] < 0.5 and 0.5 < acc["top1_agreement"]["value"] < 1.0
    for r in rows:
        assert r.latency["ttft_s"] > 0 and r.latency["tpot_s"] > 0
        assert set(r.latency["throughput_tok_s"]) == {2, 4}
    assert not fp8.failed_gate
    assert set(paths) == {"md", "json", "png"} and all(p.stat().st_size > 0 for p in paths.values())
    report = json.loads(paths["json"].read_text())
    assert report["rows"][1]["method"] == "fp8-block" and report["meta"]["device_label"] == "CPU"
    assert "| fp8 |" in paths["md"].read_text()


def test_cli_exits_1_when_an_artifact_exceeds_the_gate(pair, tmp_path):
    base, art = pair
    result = subprocess.run([sys.executable, "-m", "dsquant", "validate", str(art), "--baseline", str(base),
                             "--out", str(tmp_path / "r"), "--window", "128", "--max-eval-tokens", "300",
                             "--no-latency", "--max-ppl-increase", "-100"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "failed --max-ppl-increase: fp8" in result.stderr


def test_pareto_front_keeps_only_undominated_points():
    def row(name, tok_s, inc):
        return ArtifactRow(name, "", "", 0, {}, {"throughput_tok_s": {64: tok_s}}, inc)

    rows = [row("base", 100, 0.0), row("fast", 300, 2.0), row("worse", 250, 3.0), row("mid", 200, 0.5)]
    assert pareto(rows) == {"base", "fast", "mid"}


def test_bitsandbytes_peers_join_the_report_when_installed(pair, tmp_path):
    pytest.importorskip("bitsandbytes")
    base, art = pair
    args = ValidateArgs([str(art)], str(base), out_dir=str(tmp_path / "r"), window=128, stride=64,
                        max_eval_tokens=300, latency=False)
    rows, paths = run_validate(args, log=lambda m: None)
    peers = {r.name: r for r in rows if r.method.startswith("bitsandbytes")}
    assert set(peers) == {"bnb-nf4", "bnb-int8"}
    nf4 = peers["bnb-nf4"]
    assert nf4.accuracy, nf4.notes  # NF4 runs on CPU; its routed experts stay unquantized, said in a note
    assert 0 < nf4.accuracy["eval_prose"]["kl_mean"]["value"] < 1
    assert any("unquantized" in n for n in nf4.notes)
    for r in peers.values():  # a peer that fails is reported, not fatal
        assert r.accuracy or any(n.startswith("peer failed") for n in r.notes)
    assert "bnb-nf4" in paths["md"].read_text()
