"""Process groups of one tensor-parallel engine and the collectives the model and engine use.

Two groups, both over the same N processes:
  data     the default group: NCCL on CUDA, gloo on CPU. All-reduce of the attention and MLP
           partial sums, all-reduce of the vocab-parallel embedding, gather of the logits.
  control  gloo, CPU int64 tensors: rank 0 broadcasts each step's command and inputs. Workers
           wait in it while a server is idle, so its timeout is long; a dead peer still ends
           the wait at once (the socket closes).
Every helper is a no-op at world size 1.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from dsquant.errors import DsquantError

STEP_TIMEOUT = timedelta(minutes=10)  # a forward's collectives
IDLE_TIMEOUT = timedelta(days=30)  # workers waiting for the next step


@dataclass
class CommTimes:
    """Time this rank spends in the data group's all-reduces while it is attached to a ParallelState
    (`state.comm_times`). Rank 0's figure includes waiting for the slowest rank: it is what a step
    loses to the collectives. On CUDA each call is bracketed by two events (read by `total_s`,
    which synchronizes); on CPU gloo's all-reduce returns when done, so the host clock times it."""

    calls: int = 0
    host_s: float = 0.0
    events: list = field(default_factory=list)  # CUDA: [(start, end)] torch.cuda.Event pairs

    def total_s(self) -> float:
        if self.events:
            torch.cuda.synchronize()
        return self.host_s + sum(a.elapsed_time(b) for a, b in self.events) / 1e3


@dataclass
class ParallelState:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    control: object = None  # the gloo group for commands; None at world size 1
    comm_times: CommTimes | None = None  # set to time the all-reduces (bench engine); eager steps only

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"


def init_parallel(rank: int, world_size: int, init_method: str, device: torch.device) -> ParallelState:
    """Join the default group as `rank` and create the control group; blocks until all N joined."""
    state = ParallelState(rank, world_size, device)
    if dist.is_initialized():
        raise DsquantError("--tensor-parallel-size: this process already belongs to a torch.distributed "
                           "group; run one tensor-parallel engine per process")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(state.backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=STEP_TIMEOUT)
    state.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return state


def destroy_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum x over ranks, in place (gloo reduces 16-bit floats in float32); returns x."""
    if state.world_size == 1:
        return x
    timer = state.comm_times
    if timer is None:
        return _all_reduce_sum(x, state)
    timer.calls += 1
    if x.is_cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _all_reduce_sum(x, state)
        end.record()
        timer.events.append((start, end))
        return x
    t0 = time.perf_counter()
    _all_reduce_sum(x, state)
    timer.host_s += time.perf_counter() - t0
    return x


def _all_reduce_sum(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    if state.backend == "gloo" and x.dtype in (torch.bfloat16, torch.float16):
        wide = x.float()
        dist.all_reduce(wide)
        return x.copy_(wide)
    dist.all_reduce(x)
    return x


def all_reduce_max(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Elementwise max over ranks, in place; returns x."""
    if state is not None and state.world_size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def gather_last_dim(x: torch.Tensor, state: ParallelState, width: int, total: int) -> torch.Tensor:
    """x [..., n_r] (n_r <= width) from every rank -> rank 0: [..., total], the ranks' columns in
    rank order; other ranks get x back unchanged."""
    if state.world_size == 1:
        return x
    if x.shape[-1] < width:  # the last rank of an uneven split
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.world_size)] if state.rank == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1)[..., :total] if state.rank == 0 else x


def broadcast_ints(values: torch.Tensor | None, size: int, state: ParallelState) -> torch.Tensor:
    """int64 [size] from rank 0 to every rank over the control group (values: rank 0 only)."""
    buf = values.to(torch.int64).cpu().contiguous() if state.rank == 0 else torch.empty(size, dtype=torch.int64)
    dist.broadcast(buf, src=0, group=state.control)
    return buf


def min_over_ranks(value: int, state: ParallelState) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=state.control)
    return int(t.item())
