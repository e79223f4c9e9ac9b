"""Fuzz: a few hundred generated hostile requests, each answered 4xx with OpenAI's error body, and
the server still serving afterwards (issue 21).

Every request starts from a valid completion or chat body and gets one to three mutations, each of
which alone makes the request invalid (a wrong type, an out-of-range number, a malformed body, a
wrong header), so whatever the mix, the answer must be a 4xx. The generator is seeded: a failure
prints the case and reproduces. Bounded: ~300 requests, a few seconds on CPU.
"""
from __future__ import annotations

import json
import random
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from tests.server.openai_errors import assert_still_serving  # noqa: E402

NUM_REQUESTS = 300
MAX_REQUEST_BYTES = 64 << 10
BIG = [2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 30]
NOT_NUMBERS = ["5", [], {}, True, [1]]
BAD_FIELDS = {  # field -> values that are invalid for both routes
    "seed": BIG + ["1", 1.5, [], {}],
    "temperature": [-1, -1e-9, 2.0001, 1e308, 1e400, "NaN", "Infinity", "-Infinity"] + NOT_NUMBERS,
    "top_p": [0, -0.5, 1.0001, 1e308, "NaN", "Infinity"] + NOT_NUMBERS,
    "top_k": [-2, -(10 ** 12), 2 ** 31, 10 ** 20, 1.5] + NOT_NUMBERS,
    "max_tokens": [-1, 10 ** 6, 10 ** 30, 1.5, 1e999] + NOT_NUMBERS,
    "n": [0, 129, -1, 10 ** 20, "1"],
    "presence_penalty": [-2.01, 3, "0", "NaN"],
    "frequency_penalty": [2.01, -1e9, []],
    "repetition_penalty": [0, -1, "1", 1e300],
    "logit_bias": [{"a": 1}, {"1": 200}, {"-1": 1}, [1], {"1": "x"}, {str(10 ** 9): 1.0}],
    "stream": ["yes", 1, [], None],
    "stream_options": ["x", [], {"include_usage": "yes"}],
    "stop": [5, [1, 2], {"a": 1}],
    "model": ["gpt-4", "", 5, []],
    "ignore_eos": ["true", 0, None],
}
BAD_COMPLETION = {
    "prompt": ["", [], [[]], [-1], [10 ** 9], [1.5], {}, 5, None, "\ud800",
               "a\udfffb", ["\udbff"], "word " * 5000, [7] * 5000, ["a", ""], [[1], []], [[1], [-1]]],
    "logprobs": [-1, 21, 10 ** 9, "1"],
    "echo": ["yes", 1],
}
BAD_CHAT = {
    "messages": [[], "hi", None, [{"role": "x", "content": "hi"}], [{"role": "user"}],
                 [{"role": "user", "content": 5}], [{"role": "user", "content": "\udc00"}],
                 [{"role": "user", "content": [{"type": "image", "text": "x"}]}],
                 [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}],
                 [{"role": "user", "content": "word " * 5000}]],
    "max_completion_tokens": [0, -1, 10 ** 6, 1.5, "4"],
}


def _valid(rng: random.Random) -> tuple[str, dict]:
    base = {"max_tokens": 2, "temperature": rng.choice([0, 0.7]), "seed": rng.randrange(100)}
    if rng.random() < 0.5:
        return "completions", {**base, "prompt": rng.choice(["Once upon a time", [1, 2, 3]])}
    return "chat/completions", {**base, "messages": [{"role": "user", "content": "Hi"}]}


def _json_mutation(rng: random.Random, route: str, body: dict) -> None:
    fields = {**BAD_FIELDS, **(BAD_COMPLETION if route == "completions" else BAD_CHAT)}
    name = rng.choice(sorted(fields))
    body[name] = rng.choice(fields[name])


def _encode(body: dict) -> bytes:
    text = json.dumps(body)  # lone surrogates stay \ud800 escapes; 1e400 is written Infinity
    for word in ("NaN", "Infinity", "-Infinity"):  # the strings "NaN" etc. become bare literals
        text = text.replace(f'"{word}"', word)
    return text.encode()


RAW_MUTATIONS = [
    lambda raw, rng: raw[:rng.randrange(len(raw))],  # truncated
    lambda raw, rng: b"[" * 50_000 + raw + b"]" * 50_000,  # deeply nested
    lambda raw, rng: b'{"prompt":' + b'{"a":' * 30_000 + b"1" + b"}" * 30_001,
    lambda raw, rng: raw + b" trailing",
    lambda raw, rng: raw.replace(b'"max_tokens": 2', b'"max_tokens": ' + b"9" * 5000, 1)
    if b'"max_tokens": 2' in raw else b"1" * 5000,
    lambda raw, rng: raw.replace(b"{", b'{"top_k": ' + b"7" * rng.choice([20, 5000]) + b", ", 1),  # not in _valid
    lambda raw, rng: raw[:5] + b"\xff\xfe" + raw[5:],  # invalid UTF-8
    lambda raw, rng: b"",
    lambda raw, rng: b"null",
    lambda raw, rng: b"[1, 2]",
    lambda raw, rng: b'"just a string"',
    lambda raw, rng: b'{"prompt": "' + b"a" * (MAX_REQUEST_BYTES + 1) + b'"}',  # over the body limit
]
BAD_HEADERS = [{"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"},
               {"content-type": ""}, {"host": "evil.example"}, {"host": "127.0.0.1.nip.io:80"},
               {"content-length": str(MAX_REQUEST_BYTES * 4)}]


def hostile_request(rng: random.Random) -> tuple[str, bytes, dict]:
    """(route, raw body, headers) with at least one mutation that makes it invalid."""
    route, body = _valid(rng)
    if rng.random() < 0.3:
        body["stream"] = True
    kinds = rng.choices(["json", "raw", "header"], weights=[6, 3, 1], k=rng.randint(1, 3))
    for _ in range(kinds.count("json")):
        _json_mutation(rng, route, body)
    raw = _encode(body)
    if "raw" in kinds:
        raw = rng.choice(RAW_MUTATIONS)(raw, rng)
    headers = {"content-type": "application/json"}
    if "header" in kinds:
        headers.update(rng.choice(BAD_HEADERS))
    return route, raw, headers


def test_hostile_requests_get_4xx_openai_errors_and_the_server_keeps_serving(serve):
    rng = random.Random(21)
    t0, statuses = time.monotonic(), {}
    with serve(max_request_bytes=MAX_REQUEST_BYTES) as (url, app), httpx.Client(base_url=url, timeout=30) as c:
        for i in range(NUM_REQUESTS):
            route, raw, headers = hostile_request(rng)
            case = f"case {i}: POST /v1/{route} {headers} {raw[:300]!r}"
            if "content-length" in headers:  # over the limit by its Content-Length
                headers = {k: v for k, v in headers.items() if k != "content-length"}
                raw = raw + b" " * (MAX_REQUEST_BYTES + 1)
            r = c.post(f"/v1/{route}", content=raw, headers=headers)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert 400 <= r.status_code < 500 and r.status_code != 499, (case, r.status_code, r.text[:300])
            assert r.headers["content-type"].startswith("application/json"), (case, r.headers)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, (case, err)
            assert err["code"] == r.status_code and err["type"] and err["message"], (case, err)
            if i % 50 == 0:
                assert c.get("/health").status_code == 200, case
        assert app.state.engine_loop.alive and app.state.engine_loop.error is None
        assert_still_serving(c)
    assert set(statuses) >= {400, 415}, statuses  # the generator reaches the main kinds of refusal
    assert time.monotonic() - t0 < 120, "the fuzz run is over its time budget"
