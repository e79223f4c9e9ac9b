"""Hostile requests (issue 21, items 1, 2 and 4): out-of-range sampling fields, malformed JSON, a
failing add or step, a non-streaming client that leaves. Each is answered with OpenAI's error body
and the server keeps serving."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from tests.server.openai_errors import JSON, OK, assert_openai_error, assert_still_serving  # noqa: E402

OUT_OF_RANGE = [  # (raw JSON body, the param the 400 names)
    (b'{"prompt":"hi","max_tokens":4,"seed":18446744073709551616}', "seed"),
    (b'{"prompt":"hi","max_tokens":4,"seed":9223372036854775808}', "seed"),
    (b'{"prompt":"hi","max_tokens":4,"seed":-9223372036854775809}', "seed"),
    (b'{"prompt":"hi","temperature":2.5}', "temperature"),
    (b'{"prompt":"hi","temperature":1e308}', "temperature"),
    (b'{"prompt":"hi","temperature":NaN}', "temperature"),
    (b'{"prompt":"hi","temperature":Infinity}', "temperature"),
    (b'{"prompt":"hi","temperature":1e400}', "temperature"),
    (b'{"prompt":"hi","top_p":NaN}', "top_p"),
    (b'{"prompt":"hi","top_k":-2}', "top_k"),
    (b'{"prompt":"hi","top_k":99999999999999999999}', "top_k"),
    (b'{"prompt":"hi","max_tokens":99999999999999999999999}', "max_tokens"),
    (b'{"prompt":"hi","logprobs":99999999999999999999999}', "logprobs"),
    (b'{"messages":[{"role":"user","content":"hi"}],"seed":18446744073709551616}', "seed"),
    (b'{"messages":[{"role":"user","content":"hi"}],"temperature":-Infinity}', "temperature"),
    (b'{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":1e999}', "max_completion_tokens"),
]


def test_out_of_range_sampling_fields_are_400_and_the_engine_survives(serve):
    with serve() as (url, _), httpx.Client(base_url=url, timeout=20) as c:
        for body, param in OUT_OF_RANGE:
            route = "chat/completions" if b"messages" in body else "completions"
            assert_openai_error(c.post(f"/v1/{route}", content=body, headers=JSON), 400, param)
            with c.stream("POST", f"/v1/{route}", content=body.replace(b"{", b'{"stream":true,', 1),
                          headers=JSON) as r:
                r.read()
                assert_openai_error(r, 400, param)
        # the edges are accepted
        for extra in ({"seed": 2 ** 63 - 1}, {"seed": -(2 ** 63)}, {"temperature": 2.0}, {"top_k": -1}):
            r = c.post("/v1/completions", json={**OK, **extra})
            assert r.status_code == 200, (extra, r.text)
        assert_still_serving(c)


MALFORMED = [  # raw bodies that crashed the JSON decoder or the tokenizer (500 text/plain before)
    ("deep nesting", b"[" * 100000 + b"]" * 100000),
    ("deep object", b'{"prompt":' + b'{"a":' * 50000 + b"1" + b"}" * 50001),
    ("5000-digit int", b'{"prompt":"hi","seed":' + b"7" * 5000 + b"}"),
    ("5000-digit int, ignored field", b'{"prompt":"hi","user":' + b"7" * 5000 + b"}"),
    ("lone surrogate prompt", b'{"prompt":"\\ud800","max_tokens":2}'),
    ("lone low surrogate prompt", b'{"prompt":"a\\udfffb","max_tokens":2}'),
    ("lone surrogate prompt list", b'{"prompt":["\\ud800"],"max_tokens":2}'),
    ("lone surrogate chat", b'{"messages":[{"role":"user","content":"\\ud800"}],"max_tokens":2}'),
    ("lone surrogate chat part",
     b'{"messages":[{"role":"user","content":[{"type":"text","text":"x\\udbff"}]}],"max_tokens":2}'),
    ("invalid utf-8", b'{"prompt":"\xff\xfe","max_tokens":2}'),
    ("empty body", b""),
    ("trailing garbage", b'{"prompt":"hi"} x'),
]


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_malformed_json_is_400_with_the_openai_body(serve, route):
    with serve() as (url, _), httpx.Client(base_url=url, timeout=20) as c:
        for name, body in MALFORMED:
            r = c.post(f"/v1/{route}", content=body, headers=JSON)
            assert r.status_code == 400, (name, r.status_code, r.text[:200])
            assert_openai_error(r, 400)
        # a valid surrogate pair (an emoji) is fine
        r = c.post("/v1/completions", content=b'{"prompt":"\\ud83d\\ude00 hi","max_tokens":1}', headers=JSON)
        assert r.status_code == 200, r.text
        assert_still_serving(c)


def test_a_failing_add_fails_that_request_only(llm, serve, monkeypatch):
    real = llm.engine.add_request

    def add_request(ids, params, request_id=None):
        if params.max_tokens == 3:
            raise ValueError("simulated: this request cannot be added")
        return real(ids, params, request_id=request_id)

    monkeypatch.setattr(llm.engine, "add_request", add_request)
    with serve() as (url, app), httpx.Client(base_url=url, timeout=20) as c:
        err = assert_openai_error(c.post("/v1/completions", json={**OK, "max_tokens": 3}), 500)
        assert "simulated" in err["message"] and err["type"] == "server_error"
        with c.stream("POST", "/v1/completions", json={**OK, "max_tokens": 3, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][len("data: "):])["error"]
        assert "simulated" in err["message"] and err["code"] == 500 and err["type"] == "server_error"
        assert app.state.engine_loop.alive and app.state.engine_loop.error is None
        assert_still_serving(c)


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving(llm, serve, monkeypatch):
    real, calls = llm.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 2:  # mid-generation
            raise RuntimeError("simulated step failure")
        return real()

    monkeypatch.setattr(llm.engine, "step", step)
    with serve() as (url, app), httpx.Client(base_url=url, timeout=20) as c:
        err = assert_openai_error(c.post("/v1/completions", json={**OK, "max_tokens": 8, "ignore_eos": True}), 500)
        assert "simulated step failure" in err["message"]
        assert not llm.engine.has_unfinished() and llm.engine.block_manager.usage() == 0
        assert app.state.engine_loop.alive
        assert_still_serving(c)


def test_a_step_that_keeps_failing_stops_the_loop(llm, serve, monkeypatch):
    def broken_step():
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(llm.engine, "step", broken_step)
    with serve() as (url, app), httpx.Client(base_url=url, timeout=20) as c:
        statuses = [c.post("/v1/completions", json=OK).status_code for _ in range(4)]
        assert statuses[0] == 500 and statuses[-1] == 503, statuses
        assert c.get("/health").status_code == 503
        assert isinstance(app.state.engine_loop.error, RuntimeError)


class _LeavingRequest:
    """A request whose client has gone: receive() reports the disconnect at once."""

    async def receive(self):
        return {"type": "http.disconnect"}


class _EndlessHandle:
    async def outputs(self):
        await asyncio.Event().wait()
        yield  # pragma: no cover


def test_collect_returns_none_without_error_when_the_client_leaves(caplog):
    from dsquant.runtime.server.serving import collect

    async def main():
        loop = asyncio.get_running_loop()
        errors = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        result = await collect(_LeavingRequest(), [_EndlessHandle()], [])
        await asyncio.sleep(0.05)  # let the cancelled consumer finish
        return result, errors

    with caplog.at_level(logging.DEBUG):
        result, errors = asyncio.run(main())
    assert result is None and errors == []
    assert not [r for r in caplog.records if r.exc_info], caplog.text
