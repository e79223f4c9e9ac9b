"""Operating the server: admission control (429), disconnects free KV blocks, /health, /metrics."""
from __future__ import annotations

import contextlib
import json
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
prom_parser = pytest.importorskip("prometheus_client.parser")

MAX_NUM_SEQS = 4  # conftest's engine
LONG_RUN = {"prompt": "Once upon a time", "max_tokens": 80, "temperature": 0, "ignore_eos": True}


def wrap_step(monkeypatch, engine, gate: threading.Event | None = None, delay: float = 0.0) -> None:
    """Make each engine step wait for `gate` and/or sleep `delay` (the engine thread alone sees it)."""
    real = engine.step

    def step():
        if gate is not None:
            assert gate.wait(30), "test gate never opened"
        time.sleep(delay)
        return real()

    monkeypatch.setattr(engine, "step", step)


def samples(text: str) -> dict:
    """{(sample name, frozenset of labels other than model_name): value}, parsed by prometheus_client."""
    out = {}
    for family in prom_parser.text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


def metric(c, name: str, **labels) -> float:
    return samples(c.get("/metrics").text)[(name, frozenset(labels.items()))]


def wait_for(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_full_queue_answers_429_and_health_stays_prompt(llm, serve, monkeypatch):
    gate = threading.Event()
    wrap_step(monkeypatch, llm.engine, gate=gate)
    body = {**LONG_RUN, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    with serve(max_queue=1) as (url, _), httpx.Client(base_url=url, timeout=60) as c, \
            contextlib.ExitStack() as streams:
        try:
            # max_num_seqs running + max_queue waiting are admitted while the engine is held ...
            opened = [streams.enter_context(c.stream("POST", "/v1/completions", json=body))
                      for _ in range(MAX_NUM_SEQS + 1)]
            assert [r.status_code for r in opened] == [200] * (MAX_NUM_SEQS + 1)
            # ... and one more is refused with Retry-After
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
            t0 = time.monotonic()
            assert c.get("/health").status_code == 200
            assert c.get("/metrics").status_code == 200
            assert time.monotonic() - t0 < 2.0
        finally:
            gate.set()
        for r in opened:  # every admitted request completes with its tokens
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and '"completion_tokens":6' in events[-2]
        assert c.post("/v1/completions", json={**body, "stream": False}).status_code == 200


def test_disconnect_aborts_the_request_and_frees_its_blocks(llm, serve, monkeypatch):
    wrap_step(monkeypatch, llm.engine, delay=0.02)  # 80 tokens take >= 1.6 s: the client leaves first
    engine = llm.engine
    with serve() as (url, app), httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**LONG_RUN, "stream": True}) as r:
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: ")
                if got == 2:
                    break
            assert engine.block_manager.usage() > 0
        # leaving the block closed the connection
        wait_for(lambda: metric(c, "dsquant:request_success_total", finished_reason="abort") == 1)
        wait_for(lambda: metric(c, "dsquant:kv_cache_usage_perc") == 0)
        assert metric(c, "dsquant:num_requests_running") == 0
        assert not engine.has_unfinished() and engine.block_manager.usage() == 0

        # a non-streaming client that gives up is aborted too
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json=LONG_RUN, timeout=0.5)
        wait_for(lambda: metric(c, "dsquant:request_success_total", finished_reason="abort") == 2)
        wait_for(lambda: not engine.has_unfinished() and engine.block_manager.usage() == 0)
        assert metric(c, "dsquant:request_success_total", finished_reason="length") == 0
        assert app.state.engine_loop.num_in_flight == 0  # both left the admission count


def test_health_is_503_once_the_engine_loop_stops(serve):
    with serve() as (url, app), httpx.Client(base_url=url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        app.state.engine_loop.stop()
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == 503


HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds"]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
COUNTERS = ["prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
            "prefix_cache_hits_total"]


def test_metrics_use_vllm_names_and_count_the_requests(serve):
    shared = "The quick brown fox jumps over the lazy dog and runs far away into the deep dark forest " * 2
    fixed = {"temperature": 0, "ignore_eos": True}  # every request runs to max_tokens
    requests = [("completions", {"prompt": shared + "once", "max_tokens": 5, **fixed}),
                ("completions", {"prompt": shared + "twice", "max_tokens": 3, "stream": True,
                                 "stream_options": {"include_usage": True}, **fixed}),
                ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fixed})]
    with serve() as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        before = samples(c.get("/metrics").text)
        assert before[("dsquant:time_to_first_token_seconds_count", frozenset())] == 0
        n_in = n_out = 0
        for route, body in requests:
            r = c.post(f"/v1/{route}", json=body)
            assert r.status_code == 200
            if body.get("stream"):
                usage = [line for line in r.text.splitlines() if '"usage"' in line][-1]
                usage = json.loads(usage[len("data: "):])["usage"]
            else:
                usage = r.json()["usage"]
            n_in, n_out = n_in + usage["prompt_tokens"], n_out + usage["completion_tokens"]
        wait_for(lambda: metric(c, "dsquant:num_requests_running") == 0)
        text = c.get("/metrics").text
    for name in [f"{h}_count" for h in HISTOGRAMS] + GAUGES + COUNTERS + ["request_success_total"]:
        assert f"dsquant:{name}{{" in text, name
    m = samples(text)

    def get(name, **labels):
        return m[(f"dsquant:{name}", frozenset(labels.items()))]

    assert get("time_to_first_token_seconds_count") == len(requests)
    assert get("e2e_request_latency_seconds_count") == len(requests)
    assert get("request_queue_time_seconds_count") == len(requests)
    assert get("inter_token_latency_seconds_count") == n_out - len(requests)
    assert 0 < get("time_to_first_token_seconds_sum") < get("e2e_request_latency_seconds_sum")
    assert get("prompt_tokens_total") == n_in
    assert get("generation_tokens_total") == n_out
    assert get("request_success_total", finished_reason="length") == len(requests)
    assert get("request_success_total", finished_reason="abort") == 0
    assert get("prefix_cache_queries_total") == n_in  # every prompt token looked up once
    assert get("prefix_cache_hits_total") >= 32  # the second prompt shares >= 2 full blocks with the first
    assert get("kv_cache_usage_perc") == 0 and get("num_requests_waiting") == 0


def test_concurrent_streams_each_get_their_own_tokens(llm, serve):
    import asyncio

    from dsquant.runtime.engine.sequence import SamplingParams

    prompts = [f"Story {i}: once upon a time" for i in range(32)]
    refs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))

    async def one(c, prompt):
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) async for line in r.aiter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        return "".join(e["choices"][0]["text"] for e in events[:-1]), events[-1]["usage"]["completion_tokens"]

    async def health_latencies(c, stop: asyncio.Event):
        worst = 0.0
        while not stop.is_set():
            t0 = time.monotonic()
            assert (await c.get("/health")).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            await asyncio.sleep(0.05)
        return worst

    async def main(url):
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
            stop = asyncio.Event()
            probe = asyncio.create_task(health_latencies(c, stop))
            results = await asyncio.gather(*(one(c, p) for p in prompts))
            stop.set()
            return results, await probe

    with serve() as (url, _):
        results, worst_health = asyncio.run(main(url))
    assert [r[1] for r in results] == [6] * len(prompts)
    assert [r[0] for r in results] == [ref.text for ref in refs]
    assert worst_health < 2.0, f"/health took {worst_health:.2f} s under load"


# An engine that keeps failing stops the loop (503, /health 503): test_server_hostile.py.
