"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with it may start while the
kernel before it in the stream is still running, and waits (`griddepcontrol.wait`) only where it
first needs that kernel's output. At batch-1 decode most kernels are a few microseconds, much of it
the launch and the first loads' latency; with PDL that part overlaps the previous kernel's tail.

The contract every kernel here keeps when its PDL constexpr is on (launched through `launch()`):
1. Before `wait`, a program reads only what no kernel of the step writes (weights, scales, static
   tables), or, where its launcher says so (`PREFETCH`-style flags), data written two or more
   launches earlier. It writes nothing before `wait`.
2. Every program calls `wait`, on every path, then `release`, in that order. So when a kernel's
   successor starts, every kernel before this one has completed: the successor's early reads
   (rule 1) never race, and no more than two kernels are resident at once.
Kernels that are not launched with PDL (cuBLAS, torch's) keep full stream order around them.

Measured (`bash scripts/gpu.sh engine` against `DSQUANT_PDL=1 TAG=pdl bash scripts/gpu.sh engineon`, one
H100 in one call, 2026-12-06, V2-Lite shape, batch-1 decode tok/s): INT4 481.9 -> 543.9 (+12.9%), FP8
425.3 -> 485.0 (+14.0%), BF16 361.5 -> 381.8 (+5.6%; its projections are cuBLAS's); 64 concurrent
+1.2-2.9%. tests/kernels/test_pdl.py checks where the wait sits in each kernel's sm_90 SASS.

ENABLED switches it for the whole process (on; DSQUANT_PDL=0 turns it off); `launch(device)`
gives the kwargs of one launch: {} when off, on CPU, under TRITON_INTERPRET, on ROCm or before sm_90, else
{"PDL": True, "launch_pdl": True} (the kernel's constexpr and Triton's launch option together).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("DSQUANT_PDL", "1") != "0"


_ON = {"PDL": True, "launch_pdl": True}  # shared, only ever spread into a launch's kwargs


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    """An NVIDIA GPU of sm_90 or later (ROCm reports its own capabilities through torch.cuda)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def launch(device: torch.device) -> dict:
    """The kwargs that launch one kernel with PDL where it is on and supported (module doc)."""
    if not ENABLED or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _ON if _supported(index) else {}


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release(PDL: tl.constexpr):
    """Let the next kernel start (once every program of this one has called it or exited)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def enter(PDL: tl.constexpr):
    """wait then release: the start of a kernel that reads nothing before its inputs are ready."""
    wait(PDL)
    release(PDL)
