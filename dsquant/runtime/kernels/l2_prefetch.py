"""Weights brought into L2 ahead of the kernel that reads them (sm_90 `cp.async.bulk.prefetch.L2`).

At batch-1 decode a MoE layer reads its chosen experts' weights (V2-Lite INT4: 23 MB gate/up, 11.5 MB
down) in two launches of about 13 and 9 us, each walking its weights in small per-program slices; HBM
sits idle while a launch starts and drains, and the down projection's stream cannot start before the
gate/up one ends. A bulk prefetch is one instruction that asks the TMA unit to pull a range of bytes
into L2 without registers or shared memory, so a kernel that knows which weights come next can start
their stream early:
- moe_route, once it has chosen the experts, prefetches their gate/up weights (`ExpertPrefetch`);
- the gate/up kernels (moe_pair_mma, moe_gemm on one block per pair) prefetch their pair's share of
  the same expert's down weights, which stream while gate/up computes.
A prefetch is a hint: it changes no value, only where the later loads find their bytes. Ranges are
cut to 16-byte bounds (the instruction's rule); the bytes cut off are read from HBM as before.

Layouts: every prefetched tensor is [E, ...], contiguous, so expert e's bytes are the run
[e * bytes, (e + 1) * bytes) of its storage (GroupedWeight's weight, scales, zeros; moe_gemm.py).

ENABLED (DSQUANT_L2_PREFETCH=1) switches it for the process; off by default until the engine A/B is
measured. ROUTE_BUDGET and SHARE_BUDGET bound the bytes one launch asks for, so the gate/up and down
weights in flight fit L2 together (50 MB on H100 / H200).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("DSQUANT_L2_PREFETCH", "0") == "1"
ROUTE_BUDGET = 28 << 20  # moe_route: the chosen experts' gate/up weights
SHARE_BUDGET = 24 << 20  # the gate/up kernels: their pairs' down weights
ROUTE_PIECES = 4  # prefetch instructions per tensor per expert in moe_route (issued one after another)
SHARE_PIECES = 2  # per tensor per program in the gate/up kernels
_ASM = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $3, 0; "
                    "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def available(device: torch.device) -> bool:
    """Whether launches on `device` prefetch: ENABLED, an NVIDIA sm_90+ GPU, not under TRITON_INTERPRET
    (the interpreter runs no inline PTX)."""
    if not ENABLED or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class ExpertPrefetch:
    """Up to three [E, ...] tensors of one projection (unused slots repeat the first with 0 bytes),
    the bytes of one expert in each, and how many of a token's chosen experts to prefetch."""
    tensors: tuple
    nbytes: tuple
    count: int

    def args(self) -> tuple:
        return (*self.tensors, *self.nbytes)


def expert_regions(weight, units: int, budget: int) -> ExpertPrefetch | None:
    """The prefetch of a GroupedWeight: count = how many experts of each of `units` (tokens, or pairs
    for a count of one each) fit the budget; None when not one does or a tensor is not contiguous."""
    ts = [t for t in (weight.weight, weight.scales, weight.zeros) if t is not None]
    if any(not t.is_contiguous() or t.dim() < 2 for t in ts) or units <= 0:
        return None
    per = [t[0].numel() * t.element_size() for t in ts]
    fit = budget // max(1, sum(per) * units)
    if fit < 1:
        return None
    while len(ts) < 3:
        ts.append(ts[0])
        per.append(0)
    return ExpertPrefetch(tuple(ts), tuple(per), int(fit))


_NAMES = ("pf_w", "pf_s", "pf_z", "pf_wb", "pf_sb", "pf_zb")


def route_kwargs(weight, tokens: int, cols: int, device: torch.device) -> dict:
    """moe_route's kernel kwargs that prefetch each token's chosen experts of `weight` (the gate/up
    GroupedWeight) up to ROUTE_BUDGET; {} when off or not one expert fits."""
    if weight is None or not available(device):
        return {}
    regions = expert_regions(weight, tokens, ROUTE_BUDGET)
    if regions is None:
        return {}
    return dict(zip(_NAMES, regions.args()), PF_COUNT=min(regions.count, cols), PF_PIECES=ROUTE_PIECES)


def share_kwargs(weight, pairs: int, device: torch.device) -> dict:
    """A gate/up kernel's kwargs that make each program prefetch its share of its pair's expert in
    `weight` (the down GroupedWeight); {} when off or the pairs' experts do not all fit SHARE_BUDGET."""
    if weight is None or not available(device):
        return {}
    regions = expert_regions(weight, pairs, SHARE_BUDGET)
    if regions is None:
        return {}
    return dict(zip(_NAMES, regions.args()), PF=True, PF_PIECES=SHARE_PIECES)


@triton.jit
def prefetch_range(base, start, nbytes, PIECES: tl.constexpr):
    """Ask for bytes [start, start + nbytes) after `base` (any pointer, 16-byte aligned) in PIECES
    bulk prefetches, each cut to 16-byte bounds. Threads holding the same piece issue it once per warp."""
    b8 = base.to(tl.pointer_type(tl.int8), bitcast=True)
    piece = tl.cdiv(nbytes, PIECES)
    lo = start + tl.arange(0, PIECES).to(tl.int64) * piece  # [PIECES]
    hi = tl.minimum(lo + piece, start + nbytes)
    lo = lo - lo % 16
    hi = hi - hi % 16
    size = tl.maximum(hi - lo, 16).to(tl.int32)
    on = (hi > lo).to(tl.int32)
    tl.inline_asm_elementwise(_ASM, "=r,l,r,r", [b8 + lo, size, on], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _share(ptr, nb, e, on, share, shares, PIECES: tl.constexpr):
    nb = nb.to(tl.int64)
    part = tl.cdiv(nb, shares)
    prefetch_range(ptr, e * nb + share * part, tl.minimum(part, nb - share * part) * on, PIECES)


@triton.jit
def prefetch_expert(w_ptr, s_ptr, z_ptr, w_bytes, s_bytes, z_bytes, expert, share, shares, PIECES: tl.constexpr):
    """Share `share` of `shares` of expert `expert`'s three regions (ExpertPrefetch's tensors); a negative
    expert (another rank's) asks for nothing."""
    e = tl.maximum(expert, 0).to(tl.int64)
    on = tl.where(expert >= 0, 1, 0).to(tl.int64)
    _share(w_ptr, w_bytes, e, on, share, shares, PIECES)
    _share(s_ptr, s_bytes, e, on, share, shares, PIECES)
    _share(z_ptr, z_bytes, e, on, share, shares, PIECES)
