"""Rank 0's runner that drives the workers, and the workers' loop.

Every call that runs collectives on rank 0 (a step's forward, the CUDA memory profile) is first
announced on the control group, so all ranks enter the same collectives in the same order:
  header  int64 [4]: command, payload length, argument, 0
  STEP    payload int64: [T, B, W, S, input_ids T, positions T, slot_mapping T, q_lens B,
          seq_lens B, block_tables B*W, logits_indices S]; every rank runs ModelRunner.forward
          (rank 0 samples from the gathered logits, workers drop theirs)
  ALLOC   argument = num_blocks: allocate the KV cache
  PROFILE argument = gpu_memory_utilization * 1e6: profile, then agree on the minimum num_blocks
  STOP    leave the loop
CUDA graphs are not captured under tensor parallelism (each replay would have to be announced).
"""
from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dsquant.runtime.engine.model_runner import ModelRunner, StepInputs
from dsquant.runtime.parallel.state import ParallelState, broadcast_ints, destroy_parallel, init_parallel, min_over_ranks

log = logging.getLogger(__name__)
STEP, ALLOC, PROFILE, STOP = 1, 2, 3, 4
HEADER = 4


def send(state: ParallelState, command: int, arg: int = 0, payload: torch.Tensor | None = None) -> None:
    n = 0 if payload is None else payload.numel()
    broadcast_ints(torch.tensor([command, n, arg, 0]), HEADER, state)
    if n:
        broadcast_ints(payload, n, state)


def pack_step(inputs: StepInputs) -> torch.Tensor:
    ctx = inputs.ctx
    t, (b, w), s = inputs.input_ids.numel(), ctx.block_tables.shape, inputs.logits_indices.numel()
    parts = [torch.tensor([t, b, w, s]), inputs.input_ids.cpu(), inputs.positions.cpu(), ctx.slot_mapping.cpu(),
             torch.tensor(ctx.q_lens_host), torch.tensor(ctx.seq_lens_host), ctx.block_tables.cpu().flatten(),
             inputs.logits_indices.cpu()]
    return torch.cat([p.to(torch.int64) for p in parts])


def run_packed_step(runner: ModelRunner, payload: torch.Tensor) -> None:
    """A worker's half of one step: rebuild the context from the payload and run the forward."""
    t, b, w, s = payload[:4].tolist()
    sizes = [t, t, t, b, b, b * w, s]
    ids, pos, slots, q_lens, seq_lens, table, rows = torch.split(payload[4:], sizes)
    dev = runner.config.device
    pos = pos.to(dev)
    ctx = runner.context(pos, slots.to(dev), table.view(b, w).to(torch.int32).to(dev), q_lens.tolist(),
                         seq_lens.tolist())
    runner.forward(ids.to(dev), pos, ctx, rows.to(dev))


class DriverRunner(ModelRunner):
    """ModelRunner of rank 0: announces each collective-bearing call to the workers first."""

    def __init__(self, model, attention, config, seed: int = 0, parallel: ParallelState | None = None):
        super().__init__(model, attention, config, seed=seed)
        self.parallel = parallel
        self._profiling = False

    def prepare(self, batch) -> StepInputs:
        inputs = super().prepare(batch)
        send(self.parallel, STEP, payload=pack_step(inputs))
        return inputs

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if not self._profiling:  # the profile's own allocations happen on every rank already
            send(self.parallel, ALLOC, num_blocks)
        super().allocate_kv_cache(num_blocks)

    def profile_num_blocks(self, gpu_memory_utilization: float) -> int:
        send(self.parallel, PROFILE, int(gpu_memory_utilization * 1e6))
        self._profiling = True
        try:
            num_blocks = super().profile_num_blocks(gpu_memory_utilization)
        finally:
            self._profiling = False
        return min_over_ranks(num_blocks, self.parallel)

    def capture_cuda_graphs(self) -> None:
        log.info("tensor parallel: decoding eagerly (no CUDA graphs)")


@dataclass
class WorkerSpec:
    """What a worker needs to load its shard (pickled to the spawned process)."""

    path: Path
    config: object  # EngineConfig
    device_type: str  # "cuda" | "cpu"
    world_size: int
    init_method: str
    num_threads: int
    reader_factory: object = None  # picklable (device) -> reader stand-in (bench.random_model.RandomReaderSpec)


@torch.inference_mode()
def serve_steps(runner: ModelRunner, state: ParallelState) -> None:
    """Follow rank 0's commands until STOP."""
    while True:
        command, n, arg, _ = broadcast_ints(None, HEADER, state).tolist()
        payload = broadcast_ints(None, n, state) if n else None
        if command == STEP:
            run_packed_step(runner, payload)
        elif command == ALLOC:
            runner.allocate_kv_cache(arg)
        elif command == PROFILE:
            min_over_ranks(runner.profile_num_blocks(arg / 1e6), state)
        elif command == STOP:
            return
        else:
            raise RuntimeError(f"tensor-parallel worker {state.rank}: unknown command {command}")


def worker_main(rank: int, spec: WorkerSpec, ready) -> None:
    """Entry point of a spawned worker: join the groups, load the shard, say ready, follow rank 0."""
    from dsquant.runtime.model_builder import build_runner

    torch.set_num_threads(spec.num_threads)
    try:
        device = torch.device(spec.device_type, rank) if spec.device_type == "cuda" else torch.device("cpu")
        state = init_parallel(rank, spec.world_size, spec.init_method, device)
        config = replace(spec.config, verify_checksums=False)  # rank 0 checked the shards
        reader = spec.reader_factory(device) if spec.reader_factory is not None else None
        runner = build_runner(spec.path, config, device, reader=reader, parallel=state)
    except BaseException:
        ready.put((rank, traceback.format_exc()))
        raise SystemExit(1)
    ready.put((rank, None))
    try:
        serve_steps(runner, state)
    except Exception:  # a step failed, or rank 0 went away without STOP
        log.error("tensor-parallel worker %d stops", rank, exc_info=True)
        raise SystemExit(1)
    finally:
        destroy_parallel()
