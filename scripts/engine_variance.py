"""Where a decode step's time goes, and how much it moves between engine instances (GPU diagnostics).

python scripts/engine_variance.py OUT.json MODEL_DIR [ARTIFACT ...] [--rounds 3] [--device cuda]

Each round builds one engine per model (interleaved: A B C, A B C, ...) with validate's latency
settings (measure_latency, the tune proof's LatencySpec), and records for its timed batch-1 TPOT
runs, per decode step: wall time of engine.step(), the host CPU time of the process over it
(time.process_time), and the wall time spent in scheduling, launch (prepare + graph replay
enqueue), the wait for the sampled tokens and the post-processing; the GPU time of the graph
replays (CUDA events); context switches; the CPU the main thread ran on. So a slow instance shows
whether it was host work (CPU time up), waiting (CPU time flat, wall up) or the GPU.
"""
import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path

import torch

from dsquant.runtime.engine import cuda_graph, llm_engine
from dsquant.tune.runner import latency_spec
from dsquant.validate import latency as vlat

REC: dict = {}
PARTS = ("schedule", "launch", "finish")


def _timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            REC.setdefault(name, []).append(time.perf_counter() - t)
    return wrapper


def _cpu() -> int:
    """The CPU this thread last ran on (/proc/thread-self/stat field 39)."""
    try:
        return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return -1


def patch() -> None:
    llm_engine.launch_step = _timed("launch", llm_engine.launch_step)
    llm_engine.LLMEngine._finish_step = _timed("finish", llm_engine.LLMEngine._finish_step)
    llm_engine.Scheduler.schedule = _timed("schedule", llm_engine.Scheduler.schedule)
    step = llm_engine.LLMEngine.step

    def timed_step(self):
        batch1 = len(self.scheduler.running) == 1 and not self.scheduler.waiting
        marks = {k: len(REC.get(k, [])) for k in PARTS}
        t, c = time.perf_counter(), time.process_time()
        out = step(self)
        REC.setdefault("batch1", []).append(batch1)
        for k in PARTS:  # this step's share of each part
            REC.setdefault(f"step_{k}", []).append(sum(REC.get(k, [])[marks[k]:]))
        REC.setdefault("step", []).append(time.perf_counter() - t)
        REC.setdefault("step_cpu", []).append(time.process_time() - c)
        REC.setdefault("cpu_id", []).append(_cpu())
        return out
    llm_engine.LLMEngine.step = timed_step
    replay = cuda_graph.DecodeGraphs.replay

    def timed_replay(self, n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = replay(self, n)
        b.record()
        REC.setdefault("replay_events", []).append((n, a, b))
        return out
    cuda_graph.DecodeGraphs.replay = timed_replay


def med_us(xs) -> float | None:
    return round(statistics.median(xs) * 1e6, 1) if xs else None


def one_instance(path: str, spec, device: str) -> dict:
    REC.clear()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    result = vlat.measure_latency(path, device, spec, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    if device == "cuda":
        torch.cuda.synchronize()
    gpu = [a.elapsed_time(b) * 1e-3 for n, a, b in REC.get("replay_events", []) if n == 1]
    # the timed TPOT runs are the last repeats * tpot_output batch-1 steps before the throughput runs;
    # batch-1 steps are those whose replay had n == 1: take every record, split by step kind below
    out = {"tpot_us": round(result.tpot_s * 1e6, 1), "tpot_runs_us": [round(x * 1e6, 1) for x in result.tpot_runs],
           "throughput_tok_s": result.throughput_tok_s, "seconds": round(time.perf_counter() - t0, 1),
           "vol_ctx_switches": ru1.ru_nvcsw - ru0.ru_nvcsw, "invol_ctx_switches": ru1.ru_nivcsw - ru0.ru_nivcsw,
           "replay_gpu_us_b1": med_us(gpu), "loadavg": os.getloadavg()}
    steps, cpus = REC.get("step", []), REC.get("step_cpu", [])
    # batch-1 decode steps (one running sequence, none waiting): the TPOT runs and their warm-up
    short = [i for i, b in enumerate(REC.get("batch1", [])) if b]
    out["step_us_median"] = med_us([steps[i] for i in short])
    out["step_cpu_us_median"] = med_us([cpus[i] for i in short])
    for k in PARTS:
        out[f"{k}_us_median"] = med_us([REC[f"step_{k}"][i] for i in short])
    out["cpus_used"] = sorted(set(REC.get("cpu_id", [])))[:16]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    patch()
    spec = latency_spec([1, 64], args.device)
    report = {"spec": spec.__dict__, "affinity": sorted(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
              "instances": []}
    for r in range(args.rounds):
        for path in args.models:
            row = {"round": r, "model": Path(path).name, **one_instance(path, spec, args.device)}
            print(json.dumps(row), flush=True)
            report["instances"].append(row)
            Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
