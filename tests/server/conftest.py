"""Server tests: one engine on the bundled dsq-tiny-qwen2 (CPU), and a uvicorn server per test.

Each test starts its own app over the shared engine on 127.0.0.1 with an ephemeral port and
stops it before the next starts, so only one engine loop ever drives the engine. torch runs one
thread: on a shared 2-core machine more threads make each decode step ~100x slower.
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import torch

MAX_MODEL_LEN = 96
MAX_NUM_SEQS = 4


@pytest.fixture(scope="package")
def llm():
    pytest.importorskip("fastapi")
    from dsquant.runtime.llm import LLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM("dsq-tiny-qwen2", device="cpu", max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN)
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def running_server(app, shutdown_timeout: float = 5.0):
    """Serve `app` in a thread on 127.0.0.1:<ephemeral>; yield its base URL; stop and join on exit."""
    from dsquant.runtime.server.cli_serve import build_server

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as cli_serve._bind: no 40 ms Nagle stalls
    sock.listen(64)
    server = build_server(app, shutdown_timeout)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()
        assert not thread.is_alive(), "the test server did not stop"


@pytest.fixture
def serve(llm):
    """serve(**create_app kwargs) -> context manager yielding (base URL, app)."""
    from dsquant.runtime.server.app import create_app

    @contextlib.contextmanager
    def start(**kwargs):
        app = create_app(llm.engine, **kwargs)
        with running_server(app) as url:
            yield url, app

    yield start
    assert not llm.engine.has_unfinished(), "a test left requests in the engine"
    assert llm.engine.block_manager.usage() == 0, "a test left KV blocks in use"
