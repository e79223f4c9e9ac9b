"""Timing helpers shared by the benchmarks: CUDA-graph replay and eager medians, JSON output."""
from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, is_dataclass
from datetime import date


def time_graph_and_eager(fn, warmup_ms: int = 25, rep_ms: int = 100) -> tuple[float, float]:
    """Median microseconds of `fn` as CUDA-graph replays and as eager launches (same inputs)."""
    import triton.testing as tt

    eager = tt.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    graph = tt.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
    return graph * 1e3, eager * 1e3


def environment() -> dict:
    """Date, GPU and versions, recorded with every benchmark result."""
    import torch
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "date": date.today().isoformat(),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def write_json(path: str | None, rows: list, extra: dict | None = None) -> None:
    """Write rows (dataclasses or dicts) and the environment to `path` atomically."""
    if not path:
        return
    payload = {"env": environment(), **(extra or {}),
               "rows": [asdict(r) if is_dataclass(r) else r for r in rows]}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)
