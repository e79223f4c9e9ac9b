"""Where a decode step's time goes, and how much it moves between engine instances (GPU diagnostics).

python scripts/engine_variance.py OUT.json MODEL_DIR [ARTIFACT ...] [--rounds 3] [--device cuda]

Each round builds one engine per model (interleaved: A B C, A B C, ...) with validate's latency
settings (measure_latency, the tune proof's LatencySpec) and records every step of it through the
engine's own step timing (LLMEngine.time_steps(StepTimes()), runtime/engine/step_times.py): per
batch-1 step (one sampled row) the wall time of engine.step(), the host CPU time of the process over
it, the GPU time of its forward + sampling (CUDA events). On top of that this script splits each
step's wall time into scheduling, launch (prepare + graph replay enqueue) and post-processing (the
wait for the sampled tokens included), the launch again into prepare, replay, sample and readback
(the enqueue calls), and notes the CPU the main thread ran each launch on; and
per instance, context switches. So a slow instance shows whether it was host work (CPU time up),
waiting (CPU time flat, wall up) or the GPU.
"""
import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path

import torch

from dsquant.runtime.engine import llm_engine
from dsquant.runtime.engine.step_times import StepTimes
from dsquant.tune.runner import latency_spec
from dsquant.validate import latency as vlat

TIMES = StepTimes()  # the engine's step records of the instance being measured
PARTS = ("schedule", "launch", "finish")
# the launch's own parts: input preparation (with its host -> device copy and the block-table and
# placeholder device copies), the graph replay call, sampling's enqueue, the token read-back's enqueue
LAUNCH_PARTS = ("prepare", "replay", "sample", "readback")
SPLIT: list[tuple] = []  # (StepRecord, {part: seconds, "cpu": CPU id}) per step() call, in order


def _part(name, fn):
    """fn, its wall time added to the current step's `name` part (the launch also notes the CPU)."""
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            rec = TIMES.current
            if rec is not None:
                if not SPLIT or SPLIT[-1][0] is not rec:
                    SPLIT.append((rec, dict.fromkeys(PARTS + LAUNCH_PARTS, 0.0)))
                parts = SPLIT[-1][1]
                parts[name] += time.perf_counter() - t
                if name == "launch":
                    parts["cpu"] = _cpu()
    return wrapper


def _cpu() -> int:
    """The CPU this thread last ran on (/proc/thread-self/stat field 39)."""
    try:
        return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return -1


def patch() -> None:
    """Time the three parts of a step, which the engine's StepTimes does not split."""
    llm_engine.launch_step = _part("launch", llm_engine.launch_step)
    llm_engine.LLMEngine._finish_step = _part("finish", llm_engine.LLMEngine._finish_step)
    llm_engine.Scheduler.schedule = _part("schedule", llm_engine.Scheduler.schedule)
    from dsquant.runtime.engine import async_step, cuda_graph, model_runner

    model_runner.ModelRunner.prepare = _part("prepare", model_runner.ModelRunner.prepare)
    cuda_graph.DecodeGraphs.replay = _part("replay", cuda_graph.DecodeGraphs.replay)
    model_runner.sample = _part("sample", model_runner.sample)
    async_step.TokenReadback.start = _part("readback", async_step.TokenReadback.start)


def med_us(xs) -> float | None:
    return round(statistics.median(xs) * 1e6, 1) if xs else None


def one_instance(path: str, spec, device: str) -> dict:
    TIMES.clear()
    SPLIT.clear()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    result = vlat.measure_latency(path, device, spec, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                                  step_times=TIMES)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    if device == "cuda":
        torch.cuda.synchronize()
    # batch-1 steps (one sampled row): the TPOT runs, their warm-up and the TTFT prefills
    b1 = [r for r in TIMES.records if r.rows == 1]
    split = {id(rec): parts for rec, parts in SPLIT}  # SPLIT holds every record: no id is reused
    parts = [split.get(id(r), {}) for r in b1]
    gpu = [r.gpu[0].elapsed_time(r.gpu[1]) * 1e-3 for r in b1 if r.gpu is not None]
    out = {"tpot_us": round(result.tpot_s * 1e6, 1), "tpot_runs_us": [round(x * 1e6, 1) for x in result.tpot_runs],
           "throughput_tok_s": result.throughput_tok_s, "seconds": round(time.perf_counter() - t0, 1),
           "vol_ctx_switches": ru1.ru_nvcsw - ru0.ru_nvcsw, "invol_ctx_switches": ru1.ru_nivcsw - ru0.ru_nivcsw,
           "replay_gpu_us_b1": med_us(gpu), "loadavg": os.getloadavg(),  # forward + sampling (CUDA events)
           "step_us_median": med_us([r.wall_s for r in b1]),
           "step_cpu_us_median": med_us([r.cpu_s for r in b1]),
           "host_us_median": med_us([r.wall_s - r.wait_s for r in b1])}  # wall minus the wait for tokens
    for k in PARTS + LAUNCH_PARTS:
        out[f"{k}_us_median"] = med_us([p[k] for p in parts if k in p])
    out["cpus_used"] = sorted({p["cpu"] for p in parts if "cpu" in p})[:16]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--greedy-in-graph", action="store_true",
                    help="capture the greedy argmax in the decode graphs (cuda_graph.GREEDY_IN_GRAPH)")
    args = ap.parse_args()
    if args.greedy_in_graph:
        from dsquant.runtime.engine import cuda_graph

        cuda_graph.GREEDY_IN_GRAPH = True
    patch()
    spec = latency_spec([1, 64], args.device)
    report = {"spec": spec.__dict__, "greedy_in_graph": args.greedy_in_graph, "affinity": sorted(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
              "instances": []}
    for r in range(args.rounds):
        for path in args.models:
            row = {"round": r, "model": Path(path).name, **one_instance(path, spec, args.device)}
            print(json.dumps(row), flush=True)
            report["instances"].append(row)
            Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
