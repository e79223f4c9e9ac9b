"""`dsquant serve` as a real process: SIGTERM lets the in-flight request finish, refuses new ones, exits 0."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")


def test_sigterm_drains_in_flight_requests_and_exits_0(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    err = open(tmp_path / "stderr.txt", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "dsquant", "serve", "dsq-tiny-qwen2", "--port", "0",
                             "--device", "cpu", "--max-model-len", "96", "--max-num-seqs", "2"],
                            stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        deadline, url = time.monotonic() + 90, None
        while url is None:
            assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()
            assert time.monotonic() < deadline, "dsquant serve did not start"
            found = re.search(r"on (http://127\.0\.0\.1:\d+)", (tmp_path / "stderr.txt").read_text())
            url = found and found.group(1)
            time.sleep(0.1)
        body = {"prompt": "Once upon a time", "max_tokens": 80, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.get("/health").status_code == 200
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                proc.send_signal(signal.SIGTERM)
                refused_at: list[float] = []

                def try_new_connection():  # the listening socket closes within uvicorn's 0.1 s tick
                    for _ in range(50):
                        try:
                            httpx.get(url + "/health", timeout=1)
                        except httpx.TransportError:
                            refused_at.append(time.monotonic())
                            return
                        time.sleep(0.02)

                probe = threading.Thread(target=try_new_connection)
                probe.start()
                rest = [line for line in lines if line.startswith("data: ")]
                done_at = time.monotonic()
                probe.join(10)
        assert first and rest[-1] == "data: [DONE]"
        assert '"completion_tokens":80' in rest[-2], rest[-2]
        assert refused_at and refused_at[0] < done_at, "new connections were accepted while draining"
        assert proc.wait(30) == 0, (tmp_path / "stderr.txt").read_text()
        log = (tmp_path / "stderr.txt").read_text()
        assert re.search(r"cmpl-\w+ 200 tokens in \d+ out 80 ttft [\d.]+s total [\d.]+s", log), log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        err.close()
