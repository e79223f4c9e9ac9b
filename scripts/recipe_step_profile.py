"""Where a quantized artifact's decode step goes, kernel by kernel, against tune's latency table (GPU).

python scripts/recipe_step_profile.py OUT.json MODEL_DIR WORKDIR RECIPE [RECIPE ...] [--table TABLE.json]

Each RECIPE (a bundled name or a recipe.yaml) is quantized once into WORKDIR/<name> (reused when there),
loaded into the engine with CUDA graphs, warmed by a short greedy request, and then the batch-1 and
batch-64 decode graphs are replayed: the mean replay time over 50 replays, and a torch.profiler table of
5 replays (kernel name -> microseconds a step, launches a step). Run it once with programmatic dependent
launch on and once with DSQUANT_PDL=0: with it on, a kernel's profiled time includes its wait for the one
ahead, so only the PDL-off kernel times add up to the replay. The result says which kernels an artifact
really runs a step (e.g. shared experts folded into the fused MoE or not) and what they cost inside the
graph, against what tune's latency table (timed one Linear at a time) predicted.
"""
import argparse
import json
import os
from collections import defaultdict
from pathlib import Path

import torch

from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
from dsquant.runtime.engine.sequence import SamplingParams


def quantize(model: str, recipe: str, out: Path) -> Path:
    from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize

    if not (out / "config.json").is_file():
        run_quantize(QuantizeArgs(model, recipe, str(out), n_samples=32, seqlen=256, device="cuda", force=True))
    return out


def kernel_table(prof, steps: int) -> dict:
    rows = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if us and e.key not in ("cudaGraphLaunch", "cudaDeviceSynchronize"):
            rows[e.key][0] += us / steps
            rows[e.key][1] += e.count / steps
    return {k: {"us": round(v[0], 2), "calls": v[1]} for k, v in sorted(rows.items(), key=lambda kv: -kv[1][0])}


def profile_graph(runner, batch: int) -> dict:
    graphs = runner.graphs
    g = graphs.graphs[graphs.bucket[batch]]
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
    kernels = kernel_table(prof, 5)
    return {"replay_us": start.elapsed_time(end) / 50 * 1e3, "kernels": kernels,
            "kernel_sum_us": round(sum(v["us"] for v in kernels.values()), 2),
            "launches": sum(v["calls"] for v in kernels.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("model")
    ap.add_argument("workdir")
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--batch", default="1,64")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    pdl = os.environ.get("DSQUANT_PDL", "1") != "0"
    report = {"pdl": pdl, "gpu": torch.cuda.get_device_name(), "recipes": {}}
    for recipe in ["bf16"] + args.recipes:
        path = Path(args.model) if recipe == "bf16" else quantize(
            args.model, recipe, Path(args.workdir) / Path(recipe).stem)
        eng = LLMEngine(str(path), EngineConfig(device="cuda", dtype=torch.bfloat16, max_num_seqs=max(batches),
                                                max_model_len=256, enable_prefix_caching=False))
        eng.add_request(list(range(5, 21)), SamplingParams(max_tokens=8, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        row = {b: profile_graph(eng.runner, b) for b in batches}
        report["recipes"][recipe] = row
        for b, r in row.items():
            top = ", ".join(f"{k[:40]} {v['us']:.1f}x{v['calls']:.0f}" for k, v in list(r["kernels"].items())[:8])
            print(f"{recipe} b{b} pdl={int(pdl)}: replay {r['replay_us']:.1f} us, kernels {r['kernel_sum_us']:.1f} us "
                  f"in {r['launches']:.0f} launches; {top}", flush=True)
        del eng
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
