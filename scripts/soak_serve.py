"""Soak `dsquant serve` on CPU: N streaming clients for a fixed time, the server's RSS sampled.

PYTHONPATH=. python scripts/soak_serve.py [--model dsq-tiny-v3] [--clients 32] [--minutes 15]
    [--interval 30] [--max-tokens 32] [--malloc-arena-max N] [--json OUT.json]

Starts `dsquant serve MODEL --device cpu --port 0` on 127.0.0.1 (OMP_NUM_THREADS=1), runs
`--clients` asyncio clients that each send streaming completions back to back (varied prompts and
lengths, one in ten aborted mid-stream) until the time is up, and samples the server's VmRSS from
/proc every `--interval` seconds with the requests done so far. Prints one line per sample and a
summary: warm-up RSS (the first sample after --warmup-s), final RSS, growth per 1,000 requests
after warm-up. SIGTERM stops the server at the end (or on Ctrl-C); the script exits 1 if the
server failed, 0 otherwise. Bounded: the clients stop at the deadline, the server is always
stopped.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start_server(args) -> tuple[subprocess.Popen, str, object]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if args.malloc_arena_max:
        env["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)
    log = tempfile.NamedTemporaryFile("w+", prefix="soak-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "dsquant", "serve", args.model, "--device", "cpu", "--port", "0"]
    for flag, value in (("--max-num-seqs", args.max_num_seqs), ("--max-model-len", args.max_model_len)):
        if value is not None:
            cmd += [flag, str(value)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"dsquant serve exited {proc.returncode}: {open(log.name).read()[-2000:]}")
        found = re.search(r"on (http://127\.0\.0\.1:\d+)", open(log.name).read())
        if found:
            return proc, found.group(1), log
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("dsquant serve did not start in 180 s")
        time.sleep(0.2)


async def client(c: httpx.AsyncClient, rng: random.Random, deadline: float, counts: dict) -> None:
    words = "the a cat dog runs over under quick brown fox jumps lazy river stone light".split()
    while time.monotonic() < deadline:
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))
        body = {"prompt": prompt, "max_tokens": rng.randint(1, counts["max_tokens"]), "stream": True,
                "temperature": rng.choice([0, 0.8]), "seed": rng.randrange(1 << 30), "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        abort_after = rng.randint(1, 3) if rng.random() < 0.1 else None
        try:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if abort_after is not None and n >= abort_after:
                        counts["aborted"] += 1
                        break
                counts["status"][r.status_code] = counts["status"].get(r.status_code, 0) + 1
        except httpx.HTTPError as e:
            counts["errors"].append(repr(e))
            await asyncio.sleep(0.5)
        counts["done"] += 1


async def run(args, pid: int, url: str) -> dict:
    counts = {"done": 0, "aborted": 0, "status": {}, "errors": [], "max_tokens": args.max_tokens}
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    samples = [(0.0, 0, rss_bytes(pid))]
    print(f"{'t (s)':>7} {'requests':>9} {'RSS (MB)':>9}", flush=True)
    print(f"{0:>7.0f} {0:>9} {samples[0][2] / 1e6:>9.0f}", flush=True)
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        tasks = [asyncio.create_task(client(c, random.Random(i), deadline, counts)) for i in range(args.clients)]
        while time.monotonic() < deadline:
            await asyncio.sleep(min(args.interval, max(0.0, deadline - time.monotonic())))
            t, rss = time.monotonic() - t0, rss_bytes(pid)
            samples.append((round(t, 1), counts["done"], rss))
            print(f"{t:>7.0f} {counts['done']:>9} {rss / 1e6:>9.0f}", flush=True)
        await asyncio.gather(*tasks)
        health = (await c.get("/health")).status_code
    return {"samples": samples, "requests": counts["done"], "aborted": counts["aborted"],
            "status": counts["status"], "errors": counts["errors"][:5], "n_errors": len(counts["errors"]),
            "health_after": health}


def summarize(result: dict, warmup_s: float) -> dict:
    samples = result["samples"]
    warm = next((s for s in samples if s[0] >= warmup_s), samples[-1])
    last = samples[-1]
    per_k = (last[2] - warm[2]) / max(1, last[1] - warm[1]) * 1000
    return {"start_mb": samples[0][2] / 1e6, "warm_mb": warm[2] / 1e6, "warm_at_s": warm[0],
            "final_mb": last[2] / 1e6, "peak_mb": max(s[2] for s in samples) / 1e6,
            "growth_after_warmup_mb": (last[2] - warm[2]) / 1e6, "growth_mb_per_1000_requests": per_k / 1e6}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dsq-tiny-v3")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--minutes", type=float, default=15.0)
    p.add_argument("--interval", type=float, default=30.0)
    p.add_argument("--warmup-s", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=None, help="Default: dsquant serve's.")
    p.add_argument("--max-model-len", type=int, default=None, help="Default: dsquant serve's (the config's).")
    p.add_argument("--malloc-arena-max", type=int, default=0, help="Set MALLOC_ARENA_MAX for the server (0: leave).")
    p.add_argument("--json", default=None, help="Write samples and summary to this file.")
    args = p.parse_args()
    proc, url, log = start_server(args)
    try:
        result = asyncio.run(run(args, proc.pid, url))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(10)
    result.update(summary=summarize(result, args.warmup_s), server_exit=code, args=vars(args), log=log.name)
    print(json.dumps({k: result[k] for k in ("summary", "requests", "aborted", "status", "n_errors",
                                             "health_after", "server_exit")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if code == 0 and result["health_after"] == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
