"""In-process serving benchmark: an LLMEngine behind the HTTP server, beside its offline peer.

    engine = LLMEngine(path, EngineConfig(max_num_seqs=64))
    report = run_local_benchmark(engine, ServeBenchSpec(num_prompts=256), [1, 8, 32, 64])
    report["runs"][-1]["offline_ratio"]   # HTTP output tok/s at concurrency 64 / offline tok/s

`serve_engine` starts `create_app(engine)` under uvicorn in a background thread on a free
loopback port and stops it cleanly; `offline_throughput` adds every prompt to the engine and
steps until done (the same prompts, output length, ignore_eos and temperature as the client),
so the ratio is the share of the engine's own throughput that the HTTP path delivers.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from dataclasses import replace

from dsquant.bench.serve_client import ServeBenchSpec, run_serve_benchmark
from dsquant.bench.serve_data import BenchPrompt, load_bench_tokenizer, make_prompts
from dsquant.errors import DsquantError


@contextlib.contextmanager
def serve_engine(engine, model_name: str | None = None, api_key: str | None = None, max_queue: int = 256,
                 start_timeout_s: float = 60.0):
    """Serve `engine` on http://127.0.0.1:<free port> in a daemon thread; yield the base URL.

    The engine must be idle and driven by nothing else while the server runs; on exit the
    server drains (5 s at most), stops its engine loop and the thread is joined.
    """
    from dsquant.runtime.server.app import create_app
    from dsquant.runtime.server.cli_serve import build_server

    app = create_app(engine, model_name=model_name, api_key=api_key, max_queue=max_queue)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    server = build_server(app, shutdown_timeout=5.0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="dsquant-bench-server",
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise DsquantError("the in-process benchmark server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    if thread.is_alive():
        raise DsquantError("the in-process benchmark server did not stop within 30 s")


def offline_throughput(engine, prompts: list[BenchPrompt], output_len: int, temperature: float = 0.0) -> dict:
    """Add every prompt at once, step until all finish; output and total tokens per second."""
    from dsquant.runtime.engine.sequence import SamplingParams
    from dsquant.runtime.engine.timing import timed_generate

    if engine.has_unfinished():
        raise DsquantError("offline_throughput needs an idle engine (stop its server first)")
    run = timed_generate(engine, [p.payload for p in prompts],
                         SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True),
                         request_ids=[f"bench-offline-{i}" for i in range(len(prompts))])
    duration, total_in, total_out = run.wall_s, run.input_tokens, run.output_tokens
    return {"duration": duration, "num_prompts": len(prompts), "total_input_tokens": total_in,
            "total_output_tokens": total_out, "request_throughput": len(prompts) / duration,
            "output_throughput": total_out / duration, "total_token_throughput": (total_in + total_out) / duration,
            "max_num_seqs": engine.config.max_num_seqs}


def device_name(engine) -> str:
    """"cpu", or the CUDA device's name."""
    import torch

    dev = engine.device
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type


def run_local_benchmark(engine, spec: ServeBenchSpec, concurrencies: list[int | None],
                        model_name: str | None = None, warmup: bool = True) -> dict:
    """The offline peer, then one HTTP run per concurrency, on the same prompts.

    Returns {"offline": offline_throughput(...), "runs": [run_serve_benchmark result + offline_ratio]}.
    """
    from dsquant.data.tokenizer import backend_tokenizer

    tokenizer = backend_tokenizer(engine.path) if spec.tokenizer is None else load_bench_tokenizer(spec.tokenizer)
    prompts = make_prompts(spec.prompt_spec(), tokenizer, vocab_size=engine.model.config.vocab_size)
    need = max(len(p.token_ids) for p in prompts) + 1 + spec.output_len
    if need > engine.max_model_len:
        raise DsquantError(f"--input-len {spec.input_len} + --output-len {spec.output_len} (+ BOS) = {need} tokens "
                           f"exceed max_model_len {engine.max_model_len}")
    if warmup:  # first-call costs (allocator, lazy imports) stay out of both measurements
        offline_throughput(engine, prompts[:2], min(spec.output_len, 4), spec.temperature)
    offline = offline_throughput(engine, prompts, spec.output_len, spec.temperature)
    device = device_name(engine)
    runs = []
    max_queue = max(256, len(prompts))
    with serve_engine(engine, model_name=model_name, api_key=spec.api_key, max_queue=max_queue) as url:
        for c in concurrencies:
            result = asyncio.run(run_serve_benchmark(url, replace(spec, max_concurrency=c), prompts, device))
            result["offline_output_throughput"] = offline["output_throughput"]
            result["offline_ratio"] = result["output_throughput"] / offline["output_throughput"]
            runs.append(result)
    return {"offline": offline, "runs": runs}
