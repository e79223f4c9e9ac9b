"""Grafana dashboards against a live server's /metrics: every metric a panel's PromQL reads is exposed.

deploy/grafana/dsquant.json against the default prefix (dsquant:); the expressions of vLLM's own
example dashboard (tests/server/data/vllm_dashboard_queries.json, the panels' PromQL only) against
--metrics-prefix vllm. Histogram series (_bucket/_sum/_count) and counters (_total) are matched
as sample names, so a panel reading `x_bucket` needs the histogram `x`. A selector on model_name
must find series with the served model's name. Also: the new metrics count what was served.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
prom_parser = pytest.importorskip("prometheus_client.parser")

ROOT = Path(__file__).resolve().parents[2]
DSQUANT_DASHBOARD = ROOT / "deploy" / "grafana" / "dsquant.json"
VLLM_QUERIES = Path(__file__).parent / "data" / "vllm_dashboard_queries.json"
CLAUSES = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
KEYWORDS = {"and", "or", "unless", "bool", "offset"}
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def selectors(expr: str) -> list[tuple[str, dict]]:
    """The metric selectors of a PromQL expression: [(metric name, {label: value matched with =})]."""
    e = re.sub(r"\[[^\]]*\]", "", expr)  # range durations ($__rate_interval)
    e = CLAUSES.sub("", e)  # grouping labels
    out, pos = [], 0
    while (m := IDENT.search(e, pos)) is not None:
        pos, rest = m.end(), e[m.end():].lstrip()
        if rest.startswith("("):  # a function or aggregation
            continue
        labels = {}
        if rest.startswith("{"):
            body = rest[1:rest.index("}")]
            labels = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', body))
            pos = len(e) - len(rest) + rest.index("}") + 1
        if m.group() not in KEYWORDS:
            out.append((m.group(), labels))
    return out


def test_selectors_parse_promql():
    got = selectors('histogram_quantile(0.9, sum by(le) (rate(vllm:x_bucket{model_name="$m", a="b"}[5m])))'
                    ' / on(instance) group_left() rate(y_total[$__rate_interval]) and z')
    assert got == [("vllm:x_bucket", {"model_name": "$m", "a": "b"}), ("y_total", {}), ("z", {})]


def exposed(text: str, model_name: str) -> tuple[set[str], set[str]]:
    """(every sample name, the sample names with model_name=model_name) on a /metrics page."""
    every, model = set(), set()
    for family in prom_parser.text_string_to_metric_families(text):
        for s in family.samples:
            every.add(s.name)
            if s.labels.get("model_name") == model_name:
                model.add(s.name)
    return every, model


def missing(panels: list[tuple[str, list[str]]], text: str, model_name: str) -> dict[str, list[str]]:
    """{panel title: the metrics its expressions read that /metrics lacks}."""
    every, model = exposed(text, model_name)
    out = {}
    for title, exprs in panels:
        gone = [name for e in exprs for name, labels in selectors(e)
                if name not in (model if "model_name" in labels else every)]
        if gone:
            out[title] = sorted(set(gone))
    return out


def dsquant_panels() -> list[tuple[str, list[str]]]:
    dash = json.loads(DSQUANT_DASHBOARD.read_text())
    return [(p["title"], [t["expr"] for t in p["targets"]]) for p in dash["panels"]]


def serve_some(url: str) -> str:
    body = {"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=60) as c:
        for _ in range(2):
            assert c.post("/v1/completions", json=body).status_code == 200
        return c.get("/metrics").text


def test_dsquant_dashboard_reads_only_exposed_metrics(serve):
    panels = dsquant_panels()
    assert len(panels) >= 12
    exprs = " ".join(e for _, es in panels for e in es)
    for wanted in ("time_to_first_token", "request_time_per_output_token", "e2e_request_latency",
                   "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total", "cache_config_info",
                   "iteration_tokens_total", "request_success_total"):
        assert f"dsquant:{wanted}" in exprs, wanted
    with serve() as (url, app):
        text = serve_some(url)
        model = app.state.server.model_name
    assert missing(panels, text, model) == {}
    assert all(n.startswith("dsquant:") or not n.count(":") for _, es in panels for e in es for n, _ in selectors(e))


@pytest.mark.parametrize("index", [0, 1])
def test_vllm_dashboard_panels_all_work_with_prefix_vllm(serve, index):
    dashboard = json.loads(VLLM_QUERIES.read_text())["dashboards"][index]
    panels = [(p["title"], p["exprs"]) for p in dashboard["panels"]]
    assert len(panels) >= 12
    with serve(metrics_prefix="vllm") as (url, app):
        text = serve_some(url)
        model = app.state.server.model_name
    assert missing(panels, text, model) == {}, dashboard["name"]


def test_new_metrics_count_what_was_served(llm, serve):
    bodies = [{"prompt": "Once upon a time", "max_tokens": 5}, {"prompt": "A B C D E F G", "max_tokens": 3},
              {"prompt": "Hi", "max_tokens": 1}]
    with serve(metrics_prefix="vllm") as (url, app), httpx.Client(base_url=url, timeout=60) as c:
        n_in = n_out = 0
        for b in bodies:
            r = c.post("/v1/completions", json={**b, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200
            n_in, n_out = n_in + r.json()["usage"]["prompt_tokens"], n_out + r.json()["usage"]["completion_tokens"]
        # the response returns with the last token; the engine frees that request's KV blocks on its next
        # step, so the usage gauge reaches 0 a moment later: scrape until it does (or 5 s pass)
        for _ in range(100):
            text = c.get("/metrics").text
            if re.search(r'^vllm:kv_cache_usage_perc\{[^}]*\} 0\.0$', text, re.M):
                break
            time.sleep(0.05)
    m = {}
    for family in prom_parser.text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:"):
                assert s.labels.get("engine") == "0" and s.labels["model_name"] == app.state.server.model_name
            m.setdefault(s.name, []).append(s)

    def get(name):
        return sum(s.value for s in m[f"vllm:{name}"] if "le" not in s.labels)

    n = len(bodies)
    for h in ("request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
              "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens",
              "e2e_request_latency_seconds", "request_params_max_tokens"):
        assert get(f"{h}_count") == n, h
    assert get("request_prompt_tokens_sum") == n_in
    assert get("request_generation_tokens_sum") == get("request_max_num_generation_tokens_sum") == n_out == 9
    assert get("request_params_max_tokens_sum") == 9
    assert get("request_inference_time_seconds_sum") <= get("e2e_request_latency_seconds_sum")
    assert get("request_decode_time_seconds_sum") <= get("request_inference_time_seconds_sum")
    assert get("request_prefill_time_seconds_sum") > 0
    # every scheduled token counted once: the uncached prompt tokens plus one per decode step
    assert n_out - n <= get("iteration_tokens_total_sum") - (n_in - get("prefix_cache_hits_total")) <= n_out
    assert get("iteration_tokens_total_count") >= n_out - n
    assert get("num_preemptions_total") == 0
    assert get("gpu_cache_usage_perc") == get("kv_cache_usage_perc") == 0
    assert get("time_per_output_token_seconds_count") == get("inter_token_latency_seconds_count") == n_out - n
    assert get("num_requests_swapped") == get("cpu_cache_usage_perc") == 0
    (info,) = m["vllm:cache_config_info"]
    assert info.value == 1 and info.labels["block_size"] == str(llm.engine.config.block_size)
    assert info.labels["num_gpu_blocks"] == str(llm.engine.block_manager.num_blocks)
    assert info.labels["enable_prefix_caching"] == "True" and info.labels["cache_dtype"]
    assert "process_resident_memory_bytes" in m and "python_info" in m


def test_preemptions_count_the_engine_increments():
    from dsquant.runtime.server.metrics import ServerMetrics

    def stats(preemptions):
        return {"num_running": 1, "num_waiting": 0, "kv_cache_usage": 0.5, "prefix_cache_queries": 0,
                "prefix_cache_hits": 0, "num_preemptions": preemptions}

    metrics = ServerMetrics("tiny")
    metrics.baseline(stats(7))  # an engine that preempted before this server
    for p in (7, 8, 8, 11):
        metrics.engine_stats(stats(p))
    assert metrics.preemptions._value.get() == 4
    with pytest.raises(ValueError):
        ServerMetrics("tiny", prefix="sglang")


def test_serve_cli_takes_metrics_prefix():
    from click.testing import CliRunner

    from dsquant.runtime.server.cli_serve import serve

    result = CliRunner().invoke(serve, ["dsq-tiny-qwen2", "--metrics-prefix", "sglang"])
    assert result.exit_code == 2 and "--metrics-prefix" in result.output
    assert "--metrics-prefix [dsquant|vllm]" in CliRunner().invoke(serve, ["--help"]).output
