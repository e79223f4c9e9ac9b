"""`dsquant validate --lm-eval`: lm-evaluation-harness tasks against `dsquant serve` subprocesses.

The end-to-end test runs the bundled offline tasks (a few examples each) on the bundled
dsq-tiny-v3 and its RTN artifact; it skips when lm_eval (with its API extras) is not installed.
"""
import builtins
import json
import os
import subprocess
import sys

import pytest

from dsquant.assets import bundled_model_path
from dsquant.errors import DsquantError
from dsquant.validate.runner import ValidateArgs, run_validate


def _lm_eval_ready() -> bool:
    try:
        from dsquant.validate.harness import check_lm_eval

        check_lm_eval()
    except DsquantError:
        return False
    return True


def _serve_pids() -> set[int]:
    """Live `dsquant serve` processes started by this test process (its direct children)."""
    out = subprocess.run(["ps", "-o", "pid=,ppid=,args=", "-e"], capture_output=True, text=True).stdout
    return {int(line.split()[0]) for line in out.splitlines()
            if len(line.split()) > 2 and int(line.split()[1]) == os.getpid() and "dsquant serve" in line}


@pytest.mark.skipif(not _lm_eval_ready(), reason="lm_eval (pip install 'dsquant[lmeval]') is not installed")
def test_validate_lm_eval_scores_baseline_and_artifact_and_stops_servers(tmp_path):
    from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize

    base = bundled_model_path("dsq-tiny-v3")
    art = run_quantize(QuantizeArgs(str(base), "rtn-w4g128", str(tmp_path / "rtn"), n_samples=2, seqlen=64)).out_dir
    args = ValidateArgs([str(art)], str(base), out_dir=str(tmp_path / "report"), window=256, stride=128,
                        max_eval_tokens=300, latency=False, peers=False,
                        lm_eval="dsq_prose_cloze,dsq_prose_choice,dsq_prose_cloze_gen", lm_eval_limit=8)
    rows, paths = run_validate(args, log=lambda m: None)
    assert not _serve_pids(), "a dsquant serve process outlived validate"
    report = json.loads(paths["json"].read_text())
    assert report["meta"]["lm_eval"]["limit"] == 8
    for row in report["rows"]:
        assert not row["notes"], row["notes"]
        scores = {(t, m["metric"]): m for t, ms in row["lm_eval"].items() for m in ms}
        assert {("dsq_prose_cloze", "perplexity"), ("dsq_prose_cloze", "acc"), ("dsq_prose_choice", "acc"),
                ("dsq_prose_choice", "acc_norm"), ("dsq_prose_cloze_gen", "exact_match (first_word)")} <= set(scores)
        assert 0 <= scores[("dsq_prose_choice", "acc")]["value"] <= 1
        assert scores[("dsq_prose_cloze", "perplexity")]["value"] > 1  # a word is never certain
        assert scores[("dsq_prose_choice", "acc")]["stderr"] > 0
    # RTN changes the weights, so at least one loglikelihood score moves
    base_ppl, art_ppl = (r["lm_eval"]["dsq_prose_cloze"][0]["value"] for r in report["rows"])
    assert base_ppl != art_ppl
    md = paths["md"].read_text()
    assert "## lm-evaluation-harness" in md and "dsq_prose_cloze perplexity" in md and "| rtn |" in md
    for name in ("baseline", "rtn"):
        assert "dsquant serve: stopped" in (tmp_path / "report" / "lm_eval" / f"serve-{name}.log").read_text()


def test_lm_eval_missing_fails_before_any_work_with_install_hint(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_lm_eval(name, *a, **kw):
        if name == "lm_eval" or name.startswith("lm_eval."):
            raise ImportError(f"No module named {name!r}", name=name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_lm_eval)
    args = ValidateArgs(["/nonexistent/artifact"], "/nonexistent/baseline", out_dir=str(tmp_path / "r"),
                        lm_eval="dsq_prose_cloze")
    with pytest.raises(DsquantError, match=r"--lm-eval needs lm-evaluation-harness.*pip install 'dsquant\[lmeval\]'"):
        run_validate(args, log=lambda m: None)  # before the paths are even checked
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(not _lm_eval_ready(), reason="lm_eval is not installed")
def test_unknown_lm_eval_task_is_named_before_any_work(tmp_path):
    from dsquant.validate.harness import parse_tasks

    with pytest.raises(DsquantError, match="unknown task.*no_such_task"):
        parse_tasks("dsq_prose_cloze,no_such_task")
    yaml_path = tmp_path / "mine.yaml"
    yaml_path.write_text((bundled_model_path("dsq-tiny-v3").parent.parent / "lm_eval_tasks" / "dsq_prose_cloze.yaml")
                         .read_text().replace("task: dsq_prose_cloze", "task: my_cloze"))
    (tmp_path / "utils.py").write_text("")
    spec = parse_tasks(f"{yaml_path},dsq_prose_choice", limit=3)
    assert spec.tasks == ["my_cloze", "dsq_prose_choice"] and str(tmp_path) in spec.include_paths


def test_lm_eval_limit_without_lm_eval_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "dsquant", "validate", "x", "--baseline", "y", "--lm-eval-limit", "3"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--lm-eval-limit needs --lm-eval" in r.stderr


def test_server_that_cannot_start_is_an_error_naming_its_log(tmp_path):
    from dsquant.validate.harness import ServerProcess

    server = ServerProcess(str(tmp_path / "missing"), "x", "cpu", tmp_path / "serve.log")
    with pytest.raises(DsquantError, match=r"exited with status 2 .*serve\.log"):
        with server:
            pass
    assert server.proc.poll() is not None


def test_server_is_stopped_when_the_evaluation_raises(tmp_path):
    pytest.importorskip("fastapi")
    from dsquant.validate.harness import ServerProcess

    server = ServerProcess("dsq-tiny-qwen2", "tiny", "cpu", tmp_path / "serve.log")
    with pytest.raises(RuntimeError, match="boom"):
        with server as url:
            assert url.startswith("http://127.0.0.1:")
            raise RuntimeError("boom")
    assert server.proc.returncode == 0, "SIGTERM should drain and exit 0"  # not killed
    assert "dsquant serve: stopped" in (tmp_path / "serve.log").read_text()


@pytest.mark.skipif(not _lm_eval_ready(), reason="lm_eval (pip install 'dsquant[lmeval]') is not installed")
def test_lm_eval_scores_equal_with_batches_and_string_prompts():
    """lm-eval's local-completions with --batch_size 4 (a list of prompts per request) and with
    tokenized_requests=False (prompts sent as text, BOS included as text) scores as the default."""
    pytest.importorskip("fastapi")
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from dsquant.runtime.llm import LLM
    from dsquant.runtime.server.app import create_app
    from dsquant.validate.harness import BUNDLED_TASKS_DIR, scores
    from tests.server.conftest import running_server

    path = bundled_model_path("dsq-tiny-v3")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(str(path), device="cpu", max_num_seqs=4, max_model_len=256)
        results, tasks = {}, TaskManager(include_path=[str(BUNDLED_TASKS_DIR)])  # indexing tasks is slow: once
        with running_server(create_app(llm.engine, model_name="tiny")) as url:
            for name, extra in [("default", {}), ("batch4", {"batch_size": 4}),
                                ("text", {"tokenized_requests": False})]:
                model_args = dict(model="tiny", base_url=f"{url}/v1/completions", tokenizer=str(path),
                                  tokenizer_backend="huggingface", tokenized_requests=True, add_bos_token=True,
                                  num_concurrent=1, max_retries=1, max_length=256, max_gen_toks=16, timeout=120)
                out = simple_evaluate(model="local-completions", model_args={**model_args, **extra},
                                      tasks=["dsq_prose_cloze", "dsq_prose_choice"], limit=4,
                                      task_manager=tasks, log_samples=False, bootstrap_iters=0, verbosity="WARNING")
                results[name] = {(t, m["metric"]): m["value"] for t, ms in scores(out["results"]).items() for m in ms}
    finally:
        torch.set_num_threads(threads)
    assert results["default"] and ("dsq_prose_cloze", "perplexity") in results["default"]
    for name in ("batch4", "text"):
        assert results[name].keys() == results["default"].keys()
        for key, value in results["default"].items():
            assert results[name][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, key)
