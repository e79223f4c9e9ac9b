"""LLMEngine: requests in, tokens out, one scheduler step at a time.

    engine = LLMEngine(path, EngineConfig(device="cpu"))
    engine.add_request("Hello", SamplingParams(max_tokens=8, temperature=0))
    while engine.has_unfinished():
        for out in engine.step(): ...

With async_scheduling, step() launches the next step before reading the previous one's tokens
and returns the previous step's outputs (async_step.py); the loop above sees every token.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from dsquant.errors import DsquantError
from dsquant.runtime.engine.multi_step import burst_steps
from dsquant.runtime.engine.async_step import LaunchedStep, launch_step, must_drain
from dsquant.runtime.engine.block_manager import BlockManager
from dsquant.data.tokenizer import backend_tokenizer
from dsquant.runtime.engine.checkpoint_files import eos_ids as _eos_ids
from dsquant.runtime.engine.detokenizer import IncrementalDetokenizer
from dsquant.runtime.engine.engine_config import EngineConfig
from dsquant.runtime.engine.outputs import Cumulative, LazyDelta, RequestOutput
from dsquant.runtime.model_builder import build_runner
from dsquant.runtime.engine.scheduler import Scheduler, SchedulerConfig
from dsquant.runtime.engine.sequence import SamplingParams, Sequence
from dsquant.runtime.engine.step_times import StepRecord, StepTimes
from dsquant.runtime.layers.kv_cache import check_kv_cache_dtype

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model_path: str | Path, config: EngineConfig | None = None, reader=None,
                 reader_factory=None):
        """`reader`: a CheckpointReader stand-in for `model_path`'s weights (bench.random_model);
        `reader_factory`: a picklable (device) -> such a reader, called on every tensor-parallel rank
        (and on this process at tensor_parallel_size 1)."""
        c = config or EngineConfig()
        self.config = c = replace(c, kv_cache_dtype=check_kv_cache_dtype(c.kv_cache_dtype))
        if c.num_scheduler_steps < 1:
            raise DsquantError(f"num_scheduler_steps must be >= 1, got {c.num_scheduler_steps}")
        self.path = Path(model_path)
        device = torch.device(c.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.workers = None  # runtime.parallel.launch.Workers when tensor_parallel_size > 1
        if reader is not None and reader_factory is not None:
            raise DsquantError("LLMEngine: give a stand-in reader or a reader_factory, not both")
        if c.tensor_parallel_size > 1:
            if reader is not None:
                raise DsquantError("--tensor-parallel-size: workers read the checkpoint themselves; "
                                   "a stand-in reader needs tensor_parallel_size 1 (pass reader_factory)")
            from dsquant.runtime.parallel.launch import start_tensor_parallel

            self.workers, self.runner = start_tensor_parallel(self.path, c, device, reader_factory)
        else:
            if reader_factory is not None:
                reader = reader_factory(device)
            self.runner = build_runner(self.path, c, device, reader=reader)
        self.model = self.runner.model
        cfg = self.model.config
        max_model_len = self.runner.config.max_model_len
        try:
            num_blocks = self._allocate_kv_cache(device, max_model_len)
        except BaseException:
            self.close()
            raise
        self.block_manager = BlockManager(num_blocks, c.block_size, c.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(c.max_num_seqs, c.max_num_batched_tokens, max_model_len,
                                                   c.enable_chunked_prefill, c.long_prefill_token_threshold),
                                   self.block_manager)
        self.max_model_len = max_model_len
        self.device = device
        self.tokenizer = backend_tokenizer(Path(c.tokenizer) if c.tokenizer else self.path)
        self.eos_token_ids = _eos_ids(self.path, cfg)
        self.requests: dict[str, tuple[Sequence, IncrementalDetokenizer | None]] = {}
        self._ids = itertools.count()
        self.async_scheduling = c.async_scheduling and self.workers is None
        self.num_scheduler_steps = c.num_scheduler_steps if self.workers is None else 1
        self.pending: LaunchedStep | None = None  # launched, tokens not read yet (async scheduling)
        self.step_times: StepTimes | None = None  # set by time_steps(): each step's host / GPU split

    def time_steps(self, times: StepTimes | None) -> None:
        """Record each step's wall, wait and GPU time into `times` (step_times.py); None stops."""
        self.step_times = self.runner.step_times = times

    def _allocate_kv_cache(self, device: torch.device, max_model_len: int) -> int:
        c = self.config
        num_blocks = c.num_blocks
        if num_blocks is None:
            num_blocks = (self.runner.profile_num_blocks(c.gpu_memory_utilization) if device.type == "cuda"
                          else max(1, c.kv_cache_memory // self.runner.bytes_per_block()))
            # never more than every running sequence at full length could use
            num_blocks = min(num_blocks, c.max_num_seqs * -(-max_model_len // c.block_size) + 1)
        self.runner.allocate_kv_cache(num_blocks)
        spec, per_block = self.runner.kv_spec, self.runner.bytes_per_block()
        log.info("KV cache: %s, %d blocks x %d = %d tokens, %d bytes per token (%.2f GiB)", spec.label, num_blocks,
                 c.block_size, num_blocks * c.block_size, per_block // c.block_size, num_blocks * per_block / 2**30)
        self.runner.capture_cuda_graphs()
        return num_blocks

    def window_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits [L, vocab] of every position of `ids` run as one prefill through the engine's model
        (every tensor-parallel rank), in blocks borrowed from the cache and returned; needs an idle
        engine (nothing running or waiting) and L <= max_model_len."""
        if self.scheduler.has_unfinished() or self.pending is not None:
            raise DsquantError("window_logits needs an idle engine: requests are running or waiting")
        if not 0 < len(ids) <= self.max_model_len:
            raise DsquantError(f"window_logits: {len(ids)} tokens; the engine holds 1 to {self.max_model_len}")
        seq = Sequence(-1, "window", list(ids), SamplingParams())
        if not self.block_manager.can_allocate(seq, len(ids)):
            raise DsquantError(f"window_logits: {len(ids)} tokens do not fit the KV cache's free blocks")
        self.block_manager.allocate(seq, len(ids))
        try:
            return self.runner.window_logits(seq.token_ids, seq.block_table)
        finally:
            self.block_manager.free_seq(seq)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at interpreter exit); idempotent."""
        if getattr(self, "workers", None) is not None:
            self.workers.stop()
            self.workers = None

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise DsquantError(f"{self.path}: no tokenizer.json; pass prompt token ids instead of text")
        return self.tokenizer.encode(prompt).ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise DsquantError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise DsquantError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        need = -(-min(self.max_model_len, len(ids) + params.max_tokens) // self.config.block_size)
        if need > self.block_manager.num_blocks:
            raise DsquantError(f"the request needs {need} KV blocks; the cache has {self.block_manager.num_blocks}")
        seq_id = next(self._ids)
        request_id = request_id or f"req-{seq_id}"
        if request_id in self.requests:
            raise DsquantError(f"request id {request_id!r} is already in use")
        seq = Sequence(seq_id, request_id, ids, params, arrival_time=time.monotonic())
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        detok = IncrementalDetokenizer(self.tokenizer, params.stop, lazy=True) if self.tokenizer else None
        self.requests[request_id] = (seq, detok)
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return False
        self.scheduler.finish(entry[0], "abort")
        if self.pending is not None and not self.scheduler.has_unfinished():
            self._finish_step(self.pending)  # its tokens are all dropped now
            self.pending = None
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.pending is not None

    # ------------------------------------------------------------------ stepping
    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        p = seq.params
        return token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)

    def _check_stop(self, seq: Sequence, stop_token: bool, detok, num_tokens: int) -> str | None:
        """Why seq stops at its num_tokens-th token (prompt included; stop_token: a stop token id or
        EOS), or None."""
        if stop_token or (detok is not None and detok.stopped_on is not None):
            return "stop"
        if seq.ends_by_length(num_tokens, self.max_model_len):
            return "length"
        return None

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; read and post-process the tokens of the step launched
        before it (async scheduling) or of this one (otherwise); return their outputs."""
        times = self.step_times
        if times is None:
            return self._step()
        times.current = rec = StepRecord(0)
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return self._step()
        finally:
            rec.wall_s = time.perf_counter() - start
            rec.cpu_s = time.process_time() - cpu
            times.current = None
            if rec.rows:
                times.records.append(rec)

    def _step(self) -> list[RequestOutput]:
        pending, outputs = self.pending, []
        if pending is not None and must_drain(pending, self.scheduler):
            outputs, pending = self._finish_step(pending), None
        batch = self.scheduler.schedule()
        launched = None
        if batch.seqs:
            steps = (burst_steps(batch, self.scheduler, self.num_scheduler_steps, self.max_model_len)
                     if self.num_scheduler_steps > 1 else 1)
            launched = launch_step(self.runner, batch, self.max_model_len, pending, steps)
        if pending is not None:
            outputs = self._finish_step(pending)  # the GPU runs `launched` meanwhile
        if launched is not None and (not self.async_scheduling or not self.scheduler.has_unfinished()):
            outputs, launched = outputs + self._finish_step(launched), None  # sync, or nothing left to return
        self.pending = launched
        return outputs

    def _finish_step(self, step: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens; put them in place of their placeholders, register full
        blocks, detokenize, check stops, build the outputs. Tokens of sequences finished meanwhile
        (aborted, or stopped a step earlier) are dropped."""
        rec = self.step_times.current if self.step_times is not None else None
        wait = time.perf_counter() if rec is not None else 0.0  # no clock read on the untimed path
        tokens = iter(step.tokens.tolist() if step.tokens is not None else ())
        if rec is not None:
            rec.wait_s += time.perf_counter() - wait
        now, outputs, bm = time.monotonic(), [], self.block_manager
        if step.steps > 1:
            return self._finish_burst(step, list(tokens), now)
        for seq, index in zip(step.seqs, step.token_index):
            if index < 0:
                if not seq.is_finished:
                    bm.register_full_blocks(seq)
                continue
            token = next(tokens)
            if seq.is_finished:
                continue
            seq.token_ids[index] = token
            bm.register_full_blocks(seq, index + 1)  # a pending burst's placeholders follow
            seq.first_token_time = seq.first_token_time or now
            outputs.append(self._accept(seq, [token], index))
        return outputs

    def _accept(self, seq: Sequence, new: list[int], index: int) -> RequestOutput:
        """Detokenize and stop-check seq's new tokens (already in seq.token_ids from `index`); the
        output of those up to the first stop (a burst's later tokens are dropped)."""
        _, detok = self.requests[seq.request_id]
        kept, stop_token = len(new), False
        for j, token in enumerate(new):
            if self._is_stop_token(seq, token):
                kept, stop_token = j + 1, True
                break
        text_ids = new[:kept - 1] if stop_token else new
        mark = None
        if detok is None:
            delta = ""
        elif detok.lazy:  # no stop strings: the text is decoded when read (outputs.py)
            start = len(detok.token_ids)
            mark = detok.defer(text_ids) if text_ids else start
            delta = LazyDelta(detok, start, mark) if text_ids else ""
        elif not detok.stop or len(text_ids) < 2:
            delta = detok.add(text_ids)
        else:  # stop strings: token by token, so the one that completes a stop string ends the output there
            delta = ""
            for j, token in enumerate(text_ids):
                delta += detok.add([token])
                if detok.stopped_on is not None:
                    kept = j + 1
                    break
        reason = self._check_stop(seq, stop_token, detok, index + kept)
        if reason is not None:
            if detok is not None and not detok.lazy:
                delta += detok.flush()  # text held back for a stop string
            if kept < len(new):  # a burst's tokens after the stop: dropped
                del seq.token_ids[index + kept:]
            self.scheduler.finish(seq, reason)
            del self.requests[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, new_token_ids=new[:kept],
            delta=delta, finished=reason is not None, finish_reason=reason,
            num_cached_tokens=seq.num_cached_tokens,
            metrics={"arrival_time": seq.arrival_time, "first_token_time": seq.first_token_time},
            prompt_logprobs=seq.prompt_logprobs,
            cumulative=Cumulative(seq, index + kept, detok,
                                  None if reason is not None or detok is None or mark is not None else detok.length,
                                  None if reason is not None else mark))

    def _finish_burst(self, step: LaunchedStep, tokens: list[int], now: float) -> list[RequestOutput]:
        """_finish_step for a multi-step burst: tokens [steps * S] step-major."""
        width, outputs, bm = len(tokens) // step.steps, [], self.block_manager
        for k, (seq, index) in enumerate(zip(step.seqs, step.token_index)):
            if seq.is_finished:
                continue
            new = tokens[k::width]  # [steps]
            seq.token_ids[index:index + len(new)] = new
            bm.register_full_blocks(seq, index + len(new))
            seq.first_token_time = seq.first_token_time or now
            outputs.append(self._accept(seq, new, index))
        return outputs

    def stats(self) -> dict:
        bm = self.block_manager
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "kv_cache_usage": bm.usage(), "num_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks,
                "prefix_cache_queries": bm.prefix_cache_queries, "prefix_cache_hits": bm.prefix_cache_hits,
                "num_preemptions": self.scheduler.num_preemptions, "kv_cache_dtype": self.runner.kv_spec.label,
                "kv_cache_tokens": bm.num_blocks * bm.block_size}
