"""`dsquant bench serve`: the streaming client against the test server, and the in-process mode.

Sizes are tiny (CPU). Times and ratios are checked for sanity (positive, ordered), never
against a speed target.
"""
from __future__ import annotations

import asyncio
import json
import socket

import pytest
import torch
from click.testing import CliRunner

from dsquant.bench.serve_client import ServeBenchSpec, run_serve_benchmark
from dsquant.bench.serve_data import PromptSpec, load_bench_tokenizer, make_prompts

VLLM_FIELDS = {"duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
               "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls",
               "errors"} | {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl")}
OUR_FIELDS = {"failed", "error_messages", "request_rate", "max_concurrency", "url", "model", "date", "device"}


def _bench(url: str, spec: ServeBenchSpec, prompts=None) -> dict:
    return asyncio.run(run_serve_benchmark(url, spec, prompts))


def _check_sane(r: dict, n: int, output_len: int) -> None:
    assert r["completed"] == n and r["failed"] == 0, r["error_messages"]
    assert r["output_lens"] == [output_len] * n  # ignore_eos: every request runs to max_tokens
    assert r["total_output_tokens"] == n * output_len
    assert all(t > 0 for t in r["ttfts"]) and r["duration"] > 0
    for m in ("ttft", "tpot", "itl"):
        assert 0 < r[f"median_{m}_ms"] <= r[f"p99_{m}_ms"], m
    assert r["mean_ttft_ms"] <= max(r["ttfts"]) * 1000 + 1e-6
    assert all(len(itl) >= 1 for itl in r["itls"])  # more than one chunk per request
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])
    assert r["total_token_throughput"] > r["output_throughput"]
    assert r["errors"] == [""] * n


def test_concurrency_mode_completes_every_request_at_the_output_length(llm, serve):
    spec = ServeBenchSpec(num_prompts=6, input_len=16, output_len=8, max_concurrency=2)
    prompts = make_prompts(spec.prompt_spec(), load_bench_tokenizer(None))
    with serve() as (url, app):
        loop, submit, in_flight = app.state.engine_loop, app.state.engine_loop.submit, []

        def counting_submit(*args):
            in_flight.append(loop.num_in_flight + 1)
            return submit(*args)

        loop.submit = counting_submit
        r = _bench(url, spec, prompts)
    assert max(in_flight) == 2  # --max-concurrency 2 with 6 requests sent at once
    assert VLLM_FIELDS | OUR_FIELDS <= set(r)
    _check_sane(r, 6, 8)
    assert r["input_lens"] == [len(llm.engine.encode(p.text)) for p in prompts]  # from the server's usage
    assert r["model"] == app.state.server.model_name and r["max_concurrency"] == 2 and r["request_rate"] == "inf"
    json.dumps(r, allow_nan=False)  # plain JSON: no Infinity or NaN


def test_poisson_mode_spreads_the_arrivals(serve):
    spec = ServeBenchSpec(num_prompts=4, input_len=12, output_len=4, request_rate=20.0, dataset="corpus", seed=3)
    with serve() as (url, _):
        r = _bench(url, spec)
    _check_sane(r, 4, 4)
    starts = r["start_times"]
    assert starts == sorted(starts) and starts[-1] > starts[0]
    assert r["request_rate"] == 20.0 and r["max_concurrency"] is None


def test_prompts_have_the_input_length_and_follow_the_seed():
    tok = load_bench_tokenizer(None)
    for dataset in ("random", "corpus"):
        a = make_prompts(PromptSpec(dataset, num_prompts=3, input_len=24, seed=1), tok)
        assert [len(p.token_ids) for p in a] == [24] * 3
        assert [p.text for p in a] == [p.text for p in make_prompts(PromptSpec(dataset, 3, 24, seed=1), tok)]
        assert a[0].text != make_prompts(PromptSpec(dataset, 3, 24, seed=2), tok)[0].text
        assert len({p.text for p in a}) == 3


def test_a_wrong_api_key_fails_every_request_with_the_servers_message(serve):
    with serve(api_key="right") as (url, _):
        r = _bench(url, ServeBenchSpec(num_prompts=3, input_len=8, output_len=4, api_key="wrong"))
    assert r["completed"] == 0 and r["failed"] == 3
    assert all(e.startswith("HTTP 401") for e in r["errors"])
    assert r["error_messages"] == [r["errors"][0]] and "API key" in r["errors"][0]


def test_an_unreachable_url_fails_with_a_clear_error():
    from dsquant.cli import cli

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = CliRunner().invoke(cli, ["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--num-prompts", "2",
                                      "--input-len", "8", "--output-len", "4"])
    assert result.exit_code != 0
    assert "every request failed" in str(result.exception) and "ConnectError" in str(result.exception)
    assert "error: ConnectError" in result.output


def test_artifact_mode_serves_in_process_and_reports_the_offline_ratio(llm, tmp_path):
    from dsquant.cli import cli

    assert torch.get_num_threads() == 1  # the llm fixture keeps the shared 2-core machine usable
    out = tmp_path / "serve.json"
    result = CliRunner().invoke(cli, ["bench", "serve", "--artifact", "dsq-tiny-v3", "--device", "cpu",
                                      "--max-num-seqs", "4", "--max-model-len", "64", "--num-prompts", "4",
                                      "--input-len", "16", "--output-len", "6", "--max-concurrency", "1,4",
                                      "--dataset", "corpus", "--json", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(out.read_text())
    assert [r["max_concurrency"] for r in report["runs"]] == [1, 4]
    offline = report["offline"]
    assert offline["total_output_tokens"] == 4 * 6 and offline["output_throughput"] > 0
    for r in report["runs"]:
        _check_sane(r, 4, 6)
        assert r["offline_ratio"] == pytest.approx(r["output_throughput"] / offline["output_throughput"])
        assert r["model"] == "dsq-tiny-v3" and r["device"] == "cpu"
    assert "vs offline" in result.output and "offline peer" in result.output


def test_the_server_honours_ignore_eos(llm, serve, monkeypatch):
    import httpx

    monkeypatch.setattr(llm.engine, "eos_token_ids", set(range(llm.engine.model.config.vocab_size)))  # all EOS
    body = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
    with serve() as (url, _):
        stopped = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
        full = httpx.post(f"{url}/v1/completions", json=body | {"ignore_eos": True}, timeout=30).json()
    assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["finish_reason"] == "stop"
    assert full["usage"]["completion_tokens"] == 5 and full["choices"][0]["finish_reason"] == "length"
