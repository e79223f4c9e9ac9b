"""Big bodies (issue 21, item 3): a body limit (413), a prompt too long for max_model_len refused
before it is tokenized, and tokenizing off the event loop so one big prompt does not stall others."""
from __future__ import annotations

import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from tests.server.openai_errors import JSON, OK, assert_openai_error, assert_still_serving  # noqa: E402


class CountingTokenizer:
    """Wraps the server's tokenizer: records the length of each text encoded, sleeping first."""

    def __init__(self, inner, delay: float = 0.0):
        self.inner, self.delay, self.calls = inner, delay, []

    def encode(self, text, *args, **kwargs):
        self.calls.append(len(text))
        time.sleep(self.delay)
        return self.inner.encode(text, *args, **kwargs)

    def encode_batch(self, texts, *args, **kwargs):
        self.calls.extend(len(t) for t in texts)
        time.sleep(self.delay)
        return self.inner.encode_batch(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_bodies_over_max_request_bytes_are_413(serve):
    limit = 4096
    with serve(max_request_bytes=limit) as (url, _), httpx.Client(base_url=url, timeout=20) as c:
        big = b'{"prompt":"' + b"a" * limit + b'"}'
        err = assert_openai_error(c.post("/v1/completions", content=big, headers=JSON), 413)
        assert "--max-request-bytes" in err["message"] and str(limit) in err["message"]

        def chunks():  # no Content-Length: the limit is counted while reading
            for _ in range(8):
                yield b" " * 1024
            yield b'{"prompt":"hi"}'

        assert_openai_error(c.post("/v1/chat/completions", content=chunks(), headers=JSON), 413)
        small = b'{"prompt":"Once upon a time","max_tokens":2,"temperature":0}'
        assert c.post("/v1/completions", content=small, headers=JSON).status_code == 200
        assert_still_serving(c)


def test_the_default_body_limit_is_a_few_megabytes(llm):
    from dsquant.runtime.server.app import DEFAULT_MAX_REQUEST_BYTES, create_app

    assert 1 << 20 <= DEFAULT_MAX_REQUEST_BYTES <= 16 << 20
    assert create_app(llm.engine).state.server.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES


def test_a_prompt_too_long_for_max_model_len_is_refused_before_tokenizing_it_all(serve):
    with serve() as (url, app), httpx.Client(base_url=url, timeout=20) as c:
        prompts = app.state.server.prompts
        tok = prompts.tokenizer = CountingTokenizer(prompts.tokenizer)
        for route, body in [("completions", {"prompt": "word " * 200_000}),
                            ("chat/completions", {"messages": [{"role": "user", "content": "word " * 200_000}]})]:
            err = assert_openai_error(c.post(f"/v1/{route}", json=body), 400, "prompt")
            assert "max_model_len" in err["message"], err
        assert tok.calls and max(tok.calls) <= prompts.char_cap < 200_000, "the long prompts were tokenized whole"
        assert_still_serving(c)


def test_tokenizing_does_not_block_the_event_loop(serve):
    with serve() as (url, app), httpx.Client(base_url=url, timeout=20) as c:
        prompts = app.state.server.prompts
        prompts.tokenizer = CountingTokenizer(prompts.tokenizer, delay=1.5)
        result = {}
        slow = threading.Thread(target=lambda: result.update(r=c.post("/v1/completions", json=OK)))
        slow.start()
        time.sleep(0.3)  # the slow request is tokenizing now
        t0 = time.monotonic()
        with httpx.Client(base_url=url, timeout=20) as other:
            assert other.get("/health").status_code == 200
        took = time.monotonic() - t0
        slow.join(20)
        assert result["r"].status_code == 200, result["r"].text
        assert took < 0.6, f"/health waited {took:.2f} s for another request's tokenizer"


def test_the_listening_socket_disables_nagle():
    """Without TCP_NODELAY every JSON response waited ~40 ms: its body behind its headers' ACK."""
    import socket

    from dsquant.runtime.server.cli_serve import _bind

    sock = _bind("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        sock.close()
