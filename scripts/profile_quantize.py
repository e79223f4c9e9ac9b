"""Where `dsquant quantize` spends its time: inclusive seconds per phase, GPU-synchronised.

    python scripts/profile_quantize.py MODEL_DIR RECIPE OUT_DIR JSON [--device cuda] [--n-samples 128]

Wraps the pipeline's phases (model open, tokenizer, calibration samples, layer loads, capture
forwards, AWQ searches, clip searches, quantizers, error reports, writes, finalize) with timers
that synchronise the device before and after, runs `run_quantize` in this process, and writes
{phase: {"calls", "seconds"}} plus the wall time from interpreter start. Timings are inclusive
(a search's block-loss forwards count under both), and the synchronisation costs a little.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

T_START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

T_IMPORT_TORCH = time.perf_counter() - T_START
TOTALS: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _sync()
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _sync()
            TOTALS[name][0] += 1
            TOTALS[name][1] += time.perf_counter() - t
    return wrapper


def patch(module, attr: str, name: str | None = None) -> None:
    setattr(module, attr, timed(name or f"{module.__name__.rsplit('.', 1)[-1]}.{attr}", getattr(module, attr)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("recipe")
    p.add_argument("out_dir")
    p.add_argument("json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--n-samples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=512)
    a = p.parse_args()

    import dsquant.data as data
    from dsquant.calibrate import awq, awq_layer, capture, layer, pipeline
    from dsquant.data import tokenizer
    from dsquant.export import writer

    t_imports = time.perf_counter() - T_START
    for mod, attr in [(pipeline, "open_model"), (pipeline, "load_layer"), (pipeline, "quantize_layer"),
                      (pipeline, "layer_forward"), (pipeline, "check_layer_headers"), (pipeline, "release_layer"),
                      (layer, "_forward"), (layer, "expert_fallback"), (layer, "int_grid"), (layer, "gptq_quantize"),
                      (layer, "gptq_quantize_batch"), (layer, "fp8_block"), (layer, "relative_output_error"),
                      (awq_layer, "_fold"), (awq_layer, "_forward"), (awq, "search_scales"), (awq, "search_scales_experts"),
                      (awq, "search_clip"), (awq, "fake_quant"), (awq, "fake_int"), (awq, "candidate_scales"),
                      (data, "calibration_samples"), (tokenizer, "load_tokenizer")]:
        patch(mod, attr)
    for meth in ("write_shard", "save_progress", "finalize"):
        setattr(writer.ArtifactWriter, meth, timed(f"writer.{meth}", getattr(writer.ArtifactWriter, meth)))
    capture.LayerCapture.__enter__ = timed("capture.hooks_on", capture.LayerCapture.__enter__)
    import dsquant.models.attention as attention
    import dsquant.models.moe as moe
    for mod, cls, meth in [(moe, "MoE", "forward"), (moe, "LoopMoE", "experts"), (moe, "Router", "forward"),
                           (attention, "MLAttention", "forward"), (attention, "GQAAttention", "forward")]:
        klass = getattr(mod, cls, None)
        if klass is not None and hasattr(klass, meth):
            setattr(klass, meth, timed(f"{cls}.{meth}", getattr(klass, meth)))

    layer_seconds = []

    def progress(done, total, stats):
        layer_seconds.append(stats["seconds"])
        print(f"layer {done}/{total}: {stats['seconds']:.1f} s", flush=True)

    t = time.perf_counter()
    report = pipeline.run_quantize(pipeline.QuantizeArgs(a.model_dir, a.recipe, a.out_dir, device=a.device,
                                                         n_samples=a.n_samples, seqlen=a.seqlen, force=True),
                                   progress=progress)
    run_s = time.perf_counter() - t
    out = {"wall_from_start_s": time.perf_counter() - T_START, "import_torch_s": T_IMPORT_TORCH,
           "imports_s": t_imports, "run_quantize_s": run_s, "layer_seconds": layer_seconds,
           "seconds_total_manifest": report.manifest.get("seconds_total"),
           "peak_device_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
           "peak_host_bytes": report.manifest.get("peak_host_bytes"),
           "phases": {k: {"calls": v[0], "seconds": round(v[1], 3)}
                      for k, v in sorted(TOTALS.items(), key=lambda kv: -kv[1][1])}}
    Path(a.json).write_text(json.dumps(out, indent=1))
    for k, v in out["phases"].items():
        print(f"{k:40s} {v['calls']:6d} {v['seconds']:9.3f}")
    print({k: v for k, v in out.items() if k != "phases"})


if __name__ == "__main__":
    main()
