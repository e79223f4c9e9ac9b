"""Start a tensor-parallel engine: this process is rank 0, ranks 1..N-1 are spawned workers.

    workers, runner = start_tensor_parallel(path, engine_config, device)
    ...                      # the engine steps runner (a worker.DriverRunner)
    workers.stop()           # STOP, join, terminate what is left, leave the process group

Workers are daemon processes started with the spawn method; `stop` also runs at interpreter exit,
and a worker whose rank 0 disappears fails its next receive and exits. A worker that cannot load
its shard reports the traceback to rank 0, which raises it as a DsquantError after stopping the rest.
"""
from __future__ import annotations

import logging
import queue
import socket
import time
import weakref
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.multiprocessing as mp

from dsquant.config import load_config
from dsquant.errors import DsquantError
from dsquant.runtime.parallel.model import check_tensor_parallel
from dsquant.runtime.parallel.state import ParallelState, destroy_parallel, init_parallel
from dsquant.runtime.parallel.worker import STOP, DriverRunner, WorkerSpec, worker_main

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 1800.0  # loading a large shard from disk


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workers:
    """The spawned worker processes of one engine, seen from rank 0."""

    def __init__(self, processes: list, ready):
        self.processes, self.ready = processes, ready
        self._joined: list[ParallelState] = []  # rank 0's state once it joined; shared with the finalizer
        self._finalizer = weakref.finalize(self, _stop, processes, self._joined)

    def joined(self, state: ParallelState) -> None:
        self._joined.append(state)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Block until every worker loaded its shard; raise the first worker's error."""
        ranks = {i + 1: p for i, p in enumerate(self.processes)}
        waiting, deadline = set(ranks), time.monotonic() + timeout_s
        while waiting:
            try:
                rank, error = self.ready.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r in sorted(waiting) if not ranks[r].is_alive()]
                if dead:
                    raise DsquantError(f"--tensor-parallel-size: worker {dead[0]} exited with code "
                                       f"{ranks[dead[0]].exitcode} while loading its shard") from None
                if time.monotonic() > deadline:
                    raise DsquantError(f"--tensor-parallel-size: workers {sorted(waiting)} did not load "
                                       f"their shards within {timeout_s:.0f} s") from None
                continue
            if error is not None:
                raise DsquantError(f"--tensor-parallel-size: worker {rank} failed to load its shard:\n{error}")
            waiting.discard(rank)

    def alive(self) -> list[bool]:
        return [p.is_alive() for p in self.processes]

    def stop(self) -> None:
        self._finalizer()


def _stop(processes: list, joined: list) -> None:
    """STOP the workers (if the group is up), wait a little, then terminate and leave the group."""
    if joined:
        try:
            if not _send_stop(joined[0]):
                log.warning("tensor parallel: workers did not take STOP; terminating them")
        except Exception as e:  # a worker died: the control group is broken
            log.debug("tensor parallel: STOP failed: %s", e)
    for p in processes:
        p.join(timeout=10)
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    if joined:
        destroy_parallel()


def _send_stop(state: ParallelState) -> bool:
    import torch.distributed as dist

    header = torch.tensor([STOP, 0, 0, 0], dtype=torch.int64)
    work = dist.broadcast(header, src=0, group=state.control, async_op=True)
    return work.wait(timeout=timedelta(seconds=10))


def start_tensor_parallel(path: Path, config, device: torch.device,
                          reader_factory=None) -> tuple[Workers, DriverRunner]:
    """Validate the split, spawn the workers, load rank 0's shard; return (workers, rank 0's runner).
    reader_factory: a picklable (device) -> reader that every rank calls for its own stand-in of the
    checkpoint's tensors (random weights made on its GPU), instead of reading `path`'s files."""
    from dsquant.runtime.model_builder import build_runner

    size = config.tensor_parallel_size
    check_tensor_parallel(load_config(path), size, device)
    if device.type == "cuda":
        device = torch.device("cuda", 0)
    threads = max(1, torch.get_num_threads() // size) if device.type == "cpu" else torch.get_num_threads()
    spec = WorkerSpec(Path(path), config, device.type, size, f"tcp://127.0.0.1:{_free_port()}", threads,
                      reader_factory)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    processes = [ctx.Process(target=worker_main, args=(rank, spec, ready), daemon=True,
                             name=f"dsquant-tp-worker-{rank}") for rank in range(1, size)]
    for p in processes:
        p.start()
    workers = Workers(processes, ready)
    try:
        state = init_parallel(0, size, spec.init_method, device)
        workers.joined(state)
        runner = build_runner(Path(path), config, device, parallel=state,
                              reader=reader_factory(device) if reader_factory is not None else None,
                              runner_cls=partial(DriverRunner, parallel=state))
        workers.wait_ready()
    except BaseException:
        workers.stop()
        raise
    return workers, runner
