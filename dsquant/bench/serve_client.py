"""The async client of `dsquant bench serve`: streamed /v1/completions at a rate or a concurrency.

Requests start at Poisson arrivals of `request_rate` per second (inf: all at once), at most
`max_concurrency` in flight when set. Each streams server-sent events with
`stream_options.include_usage` and `ignore_eos: true`, so every request generates exactly
`output_len` tokens. Per request: TTFT = first chunk with choices - send time; ITL = the gaps
between later chunks; TPOT = (latency - TTFT) / (output tokens - 1); token counts come from the
server's `usage`. The result dict uses the field names of vLLM's benchmark_serving.py (times in
the per-request lists in seconds, summary statistics in ms), plus dsquant's own fields.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import urlsplit

from dsquant.bench.serve_data import BenchPrompt, PromptSpec, load_bench_tokenizer, make_prompts

MAX_ERROR_MESSAGES = 5


@dataclass
class ServeBenchSpec:
    """What one `bench serve` run sends; passed explicitly to every function here."""

    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    request_rate: float = math.inf  # requests per second, Poisson arrivals; inf: all at once
    max_concurrency: int | None = None  # at most this many requests in flight; None: no limit
    dataset: str = "random"  # "random" | "corpus"
    corpus: str = "eval_prose"
    seed: int = 0
    model: str | None = None  # None: the first model of GET /v1/models
    api_key: str | None = None
    tokenizer: str | None = None  # directory with tokenizer.json; None: the bundled tokenizer
    temperature: float = 0.0
    timeout_s: float = 600.0  # per request

    def prompt_spec(self) -> PromptSpec:
        return PromptSpec(self.dataset, self.num_prompts, self.input_len, self.seed, self.corpus)


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, send to last chunk
    itl: list[float] = field(default_factory=list)  # seconds between consecutive chunks
    start_time: float = 0.0
    error: str = ""


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _is_loopback(url: str) -> bool:
    return (urlsplit(url).hostname or "") in ("127.0.0.1", "localhost", "::1")


def _error_text(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode(errors="replace")
    return f"HTTP {status}: {message}"


async def first_model(client, url: str, api_key: str | None) -> str | None:
    """The id of the first model GET /v1/models lists; None when that fails (requests then omit it)."""
    try:
        resp = await client.get(f"{url}/v1/models", headers=_headers(api_key))
        return resp.json()["data"][0]["id"] if resp.status_code == 200 else None
    except Exception:  # noqa: BLE001 - the requests themselves report what is wrong
        return None


async def _one_request(client, url: str, spec: ServeBenchSpec, model: str | None,
                       prompt: BenchPrompt) -> RequestResult:
    body = {"prompt": prompt.payload, "max_tokens": spec.output_len, "temperature": spec.temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    out = RequestResult(prompt_len=len(prompt.token_ids), start_time=time.time())
    st = last = time.perf_counter()
    chunks, done = 0, False
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=_headers(spec.api_key)) as r:
            if r.status_code != 200:
                out.error = _error_text(r.status_code, await r.aread())
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now, chunk = time.perf_counter(), json.loads(data)
                if "error" in chunk:
                    out.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                    return out
                if chunk.get("choices"):
                    if chunks == 0:
                        out.ttft = now - st
                    else:
                        out.itl.append(now - last)
                    chunks, last = chunks + 1, now
                if chunk.get("usage"):
                    out.prompt_len = chunk["usage"]["prompt_tokens"]
                    out.output_len = chunk["usage"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - connection refused, timeouts, bad JSON: a failed request
        out.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return out
    if not done or chunks == 0:
        out.error = "the stream ended without [DONE]" if not done else "the stream had no completion chunks"
        return out
    out.output_len = out.output_len or chunks
    out.latency, out.success = last - st, True
    return out


def _stats(name: str, values_s: list[float]) -> dict:
    import numpy as np

    v = np.asarray(values_s or [0.0]) * 1000.0
    return {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
            f"std_{name}_ms": float(v.std()), f"p99_{name}_ms": float(np.percentile(v, 99))}


def summarize(outputs: list[RequestResult], duration: float) -> dict:
    """vLLM's serving metrics over the successful requests, and the per-request lists."""
    ok = [o for o in outputs if o.success]
    total_in, total_out = sum(o.prompt_len for o in ok), sum(o.output_len for o in ok)
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    errors = [o.error for o in outputs]
    messages = list(dict.fromkeys(e for e in errors if e))[:MAX_ERROR_MESSAGES]
    result = {
        "duration": duration, "completed": len(ok), "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    result |= _stats("ttft", [o.ttft for o in ok]) | _stats("tpot", tpots)
    result |= _stats("itl", [x for o in ok for x in o.itl]) | _stats("e2el", [o.latency for o in ok])
    result |= {"input_lens": [o.prompt_len for o in outputs], "output_lens": [o.output_len for o in outputs],
               "ttfts": [o.ttft for o in outputs], "itls": [o.itl for o in outputs],
               "start_times": [o.start_time for o in outputs], "errors": errors, "error_messages": messages}
    return result


async def _arrivals(n: int, rate: float, seed: int):
    """Yield 0..n-1, sleeping exponential gaps of mean 1/rate between them (a Poisson process)."""
    rng = random.Random(seed)
    for i in range(n):
        yield i
        if math.isfinite(rate) and i < n - 1:
            await asyncio.sleep(rng.expovariate(rate))


async def run_serve_benchmark(url: str, spec: ServeBenchSpec, prompts: list[BenchPrompt] | None = None,
                              device: str | None = None) -> dict:
    """Send `spec.num_prompts` streamed completions to `url` (http://host:port); the result dict.

    `prompts` (e.g. shared with an offline run) default to `make_prompts` with spec's tokenizer.
    Failed requests are counted in `failed`, with their messages in `errors` / `error_messages`.
    """
    import httpx

    url = url.rstrip("/").removesuffix("/v1")
    if prompts is None:
        prompts = make_prompts(spec.prompt_spec(), load_bench_tokenizer(spec.tokenizer))
    if spec.request_rate <= 0 or (spec.max_concurrency is not None and spec.max_concurrency < 1):
        raise ValueError(f"request_rate must be > 0 and max_concurrency >= 1, got {spec.request_rate} and "
                         f"{spec.max_concurrency}")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(spec.timeout_s, connect=10.0), limits=limits,
                                 trust_env=not _is_loopback(url)) as client:
        model = spec.model or await first_model(client, url, spec.api_key)
        gate = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None

        async def limited(prompt: BenchPrompt) -> RequestResult:
            if gate is None:
                return await _one_request(client, url, spec, model, prompt)
            async with gate:
                return await _one_request(client, url, spec, model, prompt)

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(prompts), spec.request_rate, spec.seed):
            tasks.append(asyncio.create_task(limited(prompts[i])))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    result = summarize(list(outputs), duration)
    rate = spec.request_rate if math.isfinite(spec.request_rate) else "inf"  # JSON has no Infinity
    result |= {"date": datetime.now().isoformat(timespec="seconds"), "url": url, "model": model,
               "device": device, "request_rate": rate, "max_concurrency": spec.max_concurrency,
               "num_prompts": len(prompts), "dataset": spec.dataset, "input_len": spec.input_len,
               "output_len": spec.output_len, "seed": spec.seed}
    return result
