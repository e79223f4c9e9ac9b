"""What the attention benchmarks share (attention.py, attention_fp8.py): the row, paged inputs, timing."""
from __future__ import annotations

from dataclasses import dataclass

RANK, ROPE = 512, 64  # DeepSeek's MLA latent and rope widths


@dataclass
class Row:
    kind: str
    shape: str
    dsquant_graph_us: float
    dsquant_eager_us: float
    peer_graph_us: float | None
    peer_eager_us: float | None
    speedup_vs_peer: float | None  # peer time / dsquant time (graph replays)
    achieved: float  # GB/s read (decode) or TFLOP/s (prefill), dsquant graph time
    unit: str
    check: float | None  # relative error vs the peer's output
    config: str
    best_sweep: str = ""
    sweep: list | None = None  # [(graph us, config)] of every config tried under --sweep


def _paged_copy(contig, block_size, gen):
    """contig [B, L, ...] -> (cache [B*L/bs + 1, bs, ...] with blocks scattered, block_table [B, L/bs] int32)."""
    import torch

    batch, length = contig.shape[:2]
    per_seq = length // block_size
    perm = torch.randperm(batch * per_seq + 1, generator=gen)[: batch * per_seq]
    table = perm.view(batch, per_seq).to(contig.device, torch.int32)
    cache = torch.empty(batch * per_seq + 1, block_size, *contig.shape[2:], dtype=contig.dtype, device=contig.device)
    cache[table.long().flatten()] = contig.reshape(batch * per_seq, block_size, *contig.shape[2:])
    return cache, table


def _time(fn):
    from dsquant.bench.common import time_graph_and_eager

    return time_graph_and_eager(fn)


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())
