"""Accuracy windows through a tensor-parallel engine (`dsquant validate --tensor-parallel-size N`).

With N > 1 a checkpoint's weights are split over N processes (one per GPU on cuda, gloo processes
on cpu) and no single-process model exists, so each evaluation window runs as one prefill through
the serving engine (LLMEngine.window_logits: every rank runs its shard's forward with the
collectives, rank 0 gathers the logits). validate scores the baseline and an artifact window by
window, so two such engines must be up at once, and a process belongs to one torch.distributed
group: each EngineWindows runs its engine's rank 0 in a child process of its own (which spawns the
other ranks) and asks it for one window's logits at a time over a pipe. Called on ids [B, T] it
returns the logits [B, T, vocab], the model validate.accuracy.compare expects. The baseline and
every artifact go through the same path, so their differences are the weights'.
"""
from __future__ import annotations

import multiprocessing as mp
import traceback

import torch

from dsquant.errors import DsquantError

START_TIMEOUT_S = 1800.0  # a child's engine build (its workers load their shards)


def _engine(path: str, device: str, tensor_parallel_size: int, window: int, dtype: torch.dtype, threads: int):
    from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine

    torch.set_num_threads(threads)
    block = 16
    return LLMEngine(path, EngineConfig(
        device=device, dtype=dtype, tensor_parallel_size=tensor_parallel_size, max_model_len=window,
        block_size=block, num_blocks=-(-window // block) + 1, max_num_seqs=1, max_num_batched_tokens=max(2048, window),
        enable_prefix_caching=False, enforce_eager=True))


def _serve(args: tuple, conn) -> None:
    """The child: build the engine, then answer window requests (token id lists) until None."""
    try:
        engine = _engine(*args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    try:
        while (ids := conn.recv()) is not None:
            try:
                conn.send(("ok", engine.window_logits(ids).float().cpu()))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        engine.close()


class EngineWindows:
    def __init__(self, path: str, device: str, tensor_parallel_size: int, window: int, dtype: torch.dtype):
        from dsquant.config import load_config
        from dsquant.runtime.parallel.model import check_tensor_parallel

        check_tensor_parallel(load_config(path), tensor_parallel_size, torch.device(device))  # before any spawn
        self.process = None
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        threads = max(1, torch.get_num_threads())
        self.process = ctx.Process(target=_serve, args=((path, device, tensor_parallel_size, window, dtype, threads),
                                                        child), name="dsquant-validate-tp")
        self.process.start()  # not a daemon: it spawns the engine's worker ranks
        child.close()
        self.path = path
        self._receive(START_TIMEOUT_S, "build its tensor-parallel engine")

    def _receive(self, timeout_s: float, what: str):
        if not self.conn.poll(timeout_s):
            self.close()
            raise DsquantError(f"validate --tensor-parallel-size: {self.path}: no answer within {timeout_s:.0f} s "
                               f"to {what}")
        try:
            status, payload = self.conn.recv()
        except EOFError:
            self.close()
            raise DsquantError(f"validate --tensor-parallel-size: {self.path}: the engine process exited "
                               f"(code {self.process.exitcode}) while trying to {what}") from None
        if status == "error":
            self.close()
            raise DsquantError(f"validate --tensor-parallel-size: {self.path}: failed to {what}:\n{payload}")
        return payload

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, vocab] (float32, on ids' device), one window at a time."""
        if ids.dim() != 2:
            raise DsquantError(f"EngineWindows expects ids [B, T], got {tuple(ids.shape)}")
        rows = []
        for row in ids:
            self.conn.send(row.tolist())
            rows.append(self._receive(START_TIMEOUT_S, "score a window").to(ids.device))
        return torch.stack(rows)

    def close(self) -> None:
        """Stop the engine (its workers with it); idempotent."""
        if self.process is None:
            return
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)
        self.conn.close()
        self.process = None


def check_tp_args(tensor_parallel_size: int, kv_cache_dtype: str, lm_eval: str | None) -> None:
    """What validate does not combine with --tensor-parallel-size > 1, named."""
    if tensor_parallel_size <= 1:
        return
    if kv_cache_dtype != "auto":
        raise DsquantError("--kv-cache-dtype fp8 with --tensor-parallel-size > 1: validate measures the FP8 "
                           "cache's cost at tensor-parallel size 1 only; run it without -tp")
    if lm_eval is not None:
        raise DsquantError("--lm-eval with --tensor-parallel-size > 1: the lm-eval servers run at size 1; "
                           "run it without -tp")
