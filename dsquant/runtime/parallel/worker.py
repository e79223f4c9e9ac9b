"""Rank 0's runner that drives the workers, and the workers' loop.

Every call that runs collectives on rank 0 (a step's forward, the CUDA memory profile) is first
announced on the control group, so all ranks enter the same collectives in the same order:
  header  int64 [4]: command, payload length, argument, 0
  STEP    argument EAGER: payload int64 [T, B, W, S, input_ids T, positions T, slot_mapping T,
          q_lens B, seq_lens B, block_tables B*W, logits_indices S]; every rank runs
          ModelRunner.forward (rank 0 samples from the gathered logits, workers drop theirs)
          argument GRAPH: payload int64 [n, W, input_ids n, positions n, slot_mapping n, seq_lens n,
          block_tables n*W], what rank 0 staged for a decode graph; every rank stages the same
          values into its own graph buffers and replays its graph of n's bucket
  ALLOC   argument = num_blocks: allocate the KV cache
  PROFILE argument = gpu_memory_utilization * 1e6: profile, then agree on the minimum num_blocks
  CAPTURE capture the decode CUDA graphs (their warm-ups and captures run the same collectives in
          the same order on every rank), then agree: if any rank failed, every rank decodes eagerly
  STOP    leave the loop
CUDA graphs under tensor parallelism hold the NCCL all-reduces and the logits gather. They are
captured only with TP_CUDA_GRAPHS on, which stays off until a run on several GPUs has checked
capture and replay (`TP_GRAPHS=1 bash scripts/gpu.sh tpbench`); the CPU tests cover the staging.
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
STEP, ALLOC, PROFILE, STOP, CAPTURE = 1, 2, 3, 4, 5
EAGER, GRAPH = 0, 1  # STEP's argument
HEADER = 4
TP_CUDA_GRAPHS = False  # capture decode graphs under tensor parallelism (see the module docstring)


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


def pack_graph_step(graphs, n: int, width: int) -> torch.Tensor:
    """The GRAPH payload of n decodes rank 0 has staged into `graphs` (DecodeGraphs), whose block
    tables are `width` wide: one device -> host read."""
    g = graphs
    staged = torch.cat([g.input_ids[:n], g.positions[:n], g.slot_mapping[:n], g.seq_lens[:n].to(torch.int64),
                        g.block_tables[:n, :width].to(torch.int64).flatten()])
    return torch.cat([torch.tensor([n, width]), staged.cpu()])


def run_graph_step(runner: ModelRunner, payload: torch.Tensor) -> torch.Tensor:
    """A worker's half of a graph step: stage rank 0's decode inputs into this rank's graph buffers
    and replay; returns this rank's graph output (its logits shard; rank 0 alone samples)."""
    n, width = payload[:2].tolist()
    ids, pos, slots, seq_lens, table = torch.split(payload[2:], [n, n, n, n, n * width])
    runner.graphs.stage(runner.packed, ids.tolist(), pos.tolist(), slots.tolist(), seq_lens.tolist(),
                        table.tolist(), width, [])
    return runner.graphs.replay(n)


def capture_on_every_rank(runner: ModelRunner, state: ParallelState) -> None:
    """Capture this rank's decode graphs (the base ModelRunner's capture, all-reduce timing off:
    no timing events inside a graph), then agree with the other ranks; any failure: all eager."""
    timer, state.comm_times = state.comm_times, None
    try:
        ModelRunner.capture_cuda_graphs(runner)
    finally:
        state.comm_times = timer
    if min_over_ranks(int(runner.graphs is not None), state) == 0:
        if runner.graphs is not None:
            log.warning("tensor parallel: another rank could not capture its CUDA graphs; decoding eagerly")
        runner.graphs = None


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
        if inputs.graph:
            width = max(len(s.block_table) for s in batch.seqs)  # as ModelRunner.prepare staged it
            send(self.parallel, STEP, GRAPH, pack_graph_step(self.graphs, inputs.input_ids.shape[0], width))
        else:
            self.announce(inputs)
        return inputs

    def announce(self, inputs: StepInputs) -> None:
        send(self.parallel, STEP, EAGER, pack_step(inputs))

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
        c = self.config
        if c.device.type != "cuda" or c.enforce_eager:
            return
        if not TP_CUDA_GRAPHS:
            log.info("tensor parallel: decoding eagerly (TP_CUDA_GRAPHS off)")
            return
        send(self.parallel, CAPTURE)
        capture_on_every_rank(self, self.parallel)


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
            (run_graph_step if arg == GRAPH else run_packed_step)(runner, payload)
        elif command == ALLOC:
            runner.allocate_kv_cache(arg)
        elif command == PROFILE:
            min_over_ranks(runner.profile_num_blocks(arg / 1e6), state)
        elif command == CAPTURE:
            capture_on_every_rank(runner, state)
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
