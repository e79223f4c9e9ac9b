"""Profile decode steps of the engine on the V2-Lite-shaped random model (GPU diagnostics).

python scripts/gpu_engine_profile.py OUT_DIR [scheme ...]: per scheme, whether CUDA graphs were
captured, host time per step split into prepare / execute / rest, and a torch.profiler table of
a few batch-1 decode steps (CPU and CUDA time per op), written under OUT_DIR.
PROFILE_BATCH=N (default 0: off) adds the same for N concurrent sequences (bench engine's 512-token
prompts): each step's wall time (unsynchronized, as the bench runs) over a full run (prefill steps against decode
steps), and the kernels of 5 replays of the batch-N decode graph with the run's own inputs staged.
With programmatic dependent launch on (runtime/kernels/pdl.py, the default) a kernel starts before the one
ahead of it ends, so its profiled time includes that wait and the kernel times add up to more than the
replay; run with DSQUANT_PDL=0 for per-kernel times that add up.
"""
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from dsquant.bench.engine import EngineBenchSpec, _prompts, build_engine, run_requests
from dsquant.runtime.engine.sequence import SamplingParams

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
out = Path(sys.argv[1])
schemes = sys.argv[2:] or ["bf16", "int4"]
BATCH = int(os.environ.get("PROFILE_BATCH", "0"))
spec = EngineBenchSpec(concurrency=max(8, BATCH))
report = {}


def profile_batch(eng, batch: int, path: Path) -> dict:
    """Run `batch` 512-token prompts to 128 output tokens: per-step wall time split into steps
    that prefill and decode-only steps; halfway, profile 5 replays of the batch-size graph on
    the inputs staged for that step (the run's real lengths)."""
    runner = eng.runner
    for p in _prompts(batch, 512, 32000, 9):
        eng.add_request(p, SamplingParams(max_tokens=128, ignore_eos=True))
    prefill_ms, decode_ms, n = [], [], 0
    while eng.has_unfinished():
        tokens = sum(s.num_uncomputed_tokens for s in eng.scheduler.running) + \
            sum(s.num_tokens for s in eng.scheduler.waiting)
        t = time.perf_counter()  # no syncs: async steps overlap as in the bench
        eng.step()
        (decode_ms if tokens <= batch else prefill_ms).append((time.perf_counter() - t) * 1e3)
        n += 1
        if n == 64 and runner.graphs is not None and batch in runner.graphs.bucket:
            g = runner.graphs.graphs[runner.graphs.bucket[batch]]
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(10):
                g.replay()
            torch.cuda.synchronize()
            replay_ms = (time.perf_counter() - t) / 10 * 1e3
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    g.replay()
                torch.cuda.synchronize()
            path.write_text(f"graph replay {replay_ms:.3f} ms a step (batch {batch})\n" +
                            prof.key_averages().table(sort_by="cuda_time_total", row_limit=60))
    med = lambda v: sorted(v)[len(v) // 2] if v else None  # noqa: E731
    return {"prefill_steps": len(prefill_ms), "prefill_ms_total": sum(prefill_ms),
            "decode_steps": len(decode_ms), "decode_ms_median": med(decode_ms), "decode_ms_total": sum(decode_ms)}

with tempfile.TemporaryDirectory() as tmp:
    for scheme in schemes:
        eng, reader, load_s = build_engine(scheme, spec, Path(tmp), 1024)
        runner = eng.runner
        info = {"load_s": load_s, "graphs": runner.graphs is not None,
                "graph_sizes": getattr(runner.graphs, "sizes", None)}
        run_requests(eng, _prompts(2, 512, 32000, 5), 8)
        # host-side split of batch-1 decode steps
        t_prep, t_exec = [], []
        orig_prepare, orig_execute = runner.prepare, runner.execute

        def prepare(batch):
            t = time.perf_counter()
            r = orig_prepare(batch)
            t_prep.append(time.perf_counter() - t)
            return r

        def execute(batch):
            t = time.perf_counter()
            r = orig_execute(batch)
            t_exec.append(time.perf_counter() - t)
            return r

        runner.prepare, runner.execute = prepare, execute
        eng.add_request(_prompts(1, 512, 32000, 6)[0], SamplingParams(max_tokens=64, ignore_eos=True))
        eng.step()  # prefill
        steps = []
        while eng.has_unfinished():
            t = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t)
        runner.prepare, runner.execute = orig_prepare, orig_execute
        # host profile of decode steps (cProfile): where the Python time goes
        import cProfile
        import io
        import pstats
        eng.add_request(_prompts(1, 512, 32000, 8)[0], SamplingParams(max_tokens=40, ignore_eos=True))
        eng.step()
        pr = cProfile.Profile()
        pr.enable()
        while eng.has_unfinished():
            eng.step()
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(60)
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(40)
        (out / f"cprofile_{scheme}.txt").write_text(buf.getvalue())
        med = lambda v: sorted(v)[len(v) // 2] * 1e3 if v else None  # noqa: E731 (async steps skip execute)
        info.update(step_ms=med(steps), prepare_ms=med(t_prep[1:]), execute_ms=med(t_exec[1:]))
        # graph replay alone
        if runner.graphs is not None:
            g = runner.graphs.graphs[1]
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                g.replay()
            torch.cuda.synchronize()
            info["graph_replay_ms"] = (time.perf_counter() - t) / 20 * 1e3
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    g.replay()
                torch.cuda.synchronize()
            (out / f"replay_kernels_{scheme}.txt").write_text(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=60))
        eng.add_request(_prompts(1, 512, 32000, 7)[0], SamplingParams(max_tokens=12, ignore_eos=True))
        eng.step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            while eng.has_unfinished():
                eng.step()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
        (out / f"profile_{scheme}.txt").write_text(
            table + "\n\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
        if BATCH:
            info["batch"] = profile_batch(eng, BATCH, out / f"replay_kernels_{scheme}_b{BATCH}.txt")
        report[scheme] = info
        print(scheme, info, flush=True)
        (out / "profile.json").write_text(json.dumps(report, indent=1))
        del eng, runner
        import gc
        gc.collect()
        torch.cuda.empty_cache()
