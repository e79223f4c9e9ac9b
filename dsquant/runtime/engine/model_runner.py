"""Builds each step's flattened batch and runs the model over the paged KV cache.

The batch runs as B=1, T=num_tokens (every sequence's new tokens back to back). Per step:
input_ids [T], positions [T], slot_mapping [T] (where each new token's K/V go), block_tables
[B, max_blocks], seq_lens [B] (cached + new), cu_seqlens_q [B + 1]; logits are computed only for
the last new token of each sequence that samples this step (a prefill chunk short of the end of
the prompt samples nothing), plus every prompt position of a sequence that asked for
prompt_logprobs. All of these and the sampling parameters reach the device in one host -> device
copy (packed_copy.py). On CUDA, pure-decode batches replay captured CUDA graphs (cuda_graph.py)
unless enforce_eager; their inputs are copied straight into the graphs' static buffers. Under
async scheduling an input id may be a placeholder for a token the previous step sampled: it is
filled on the device from that step's tokens (batch.prev_tokens) before the forward.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from dsquant.models.layers import PagedAttentionBackend
from dsquant.runtime.engine.async_step import SampledTokens, TokenReadback, fill_placeholders
from dsquant.runtime.engine.logprobs import record_prompt_logprobs, record_sampled_logprobs
from dsquant.runtime.engine.multi_step import run_burst
from dsquant.runtime.engine.packed_copy import PackedCopy
from dsquant.runtime.engine.penalties import PenaltyTensors
from dsquant.runtime.engine.sampler import SamplingTensors, sample
from dsquant.runtime.engine.scheduler import ScheduledBatch
from dsquant.runtime.layers.attention import PagedContext
from dsquant.runtime.layers.kv_cache import KVCacheSpec, allocate_kv_caches, kv_bytes_per_block

log = logging.getLogger(__name__)


@dataclass
class RunnerConfig:
    device: torch.device
    dtype: torch.dtype
    block_size: int = 16
    max_model_len: int = 4096
    max_num_batched_tokens: int = 2048
    enforce_eager: bool = True
    cuda_graph_max_batch: int = 64
    kv_cache_dtype: str = "auto"  # "auto" (dtype) or "fp8" (layers/kv_cache.py)
    num_scheduler_steps: int = 1  # > 1: the decode graphs also capture burst steps (multi_step.py)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    ctx: PagedContext | None  # None when the decode CUDA graph runs (it has its own)
    logits_indices: torch.Tensor  # [S] int64, rows of T whose logits are sampled
    sampling_seqs: list  # the S sequences that sample, in order
    # prompt_logprobs: (seq, first position, count); their logits rows follow the S sampled ones
    prompt_spans: list = field(default_factory=list)
    sampling: SamplingTensors | None = None  # the sampling rows' parameters, on the device
    graph: bool = False  # inputs are staged in the decode CUDA graphs' static buffers
    penalties: PenaltyTensors | None = None  # None unless a sampling row has penalties or logit_bias


class ModelRunner:
    def __init__(self, model, attention: PagedAttentionBackend, config: RunnerConfig, seed: int = 0):
        self.model, self.attention, self.config = model, attention, config
        self.cfg = model.config
        model.inv_freq = model.inv_freq.to(config.device)  # so rope_cos_sin never copies host -> device
        self.kv_caches: list[tuple] = []
        self.graphs = None
        self.generator = torch.Generator(device=config.device).manual_seed(seed)
        self.packed = PackedCopy(config.device)  # the step's one host -> device copy
        self.readback = TokenReadback(config.device)  # sampled tokens -> host, without a stream sync
        self.step_times = None  # engine/step_times.StepTimes while LLMEngine.time_steps records

    # ------------------------------------------------------------------ KV cache
    @property
    def kv_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.config.kv_cache_dtype, self.config.dtype)

    def bytes_per_block(self) -> int:
        """The KV cache's real bytes per block (all layers), which size the cache."""
        return kv_bytes_per_block(self.cfg, self.config.block_size, self.kv_spec)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.cfg, self.kv_spec, num_blocks, self.config.block_size,
                                            self.config.device)
        self.attention.bind(self.model, self.kv_caches, self.kv_spec)
        self.num_blocks = num_blocks

    @torch.inference_mode()
    def profile_num_blocks(self, gpu_memory_utilization: float) -> int:
        """CUDA: run the largest step once, then give the KV cache what the budget leaves."""
        c = self.config
        tokens = min(c.max_num_batched_tokens, c.max_model_len)
        blocks = -(-tokens // c.block_size)
        self.allocate_kv_cache(blocks)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        ids = torch.zeros(tokens, dtype=torch.int64, device=c.device)
        pos = torch.arange(tokens, device=c.device)
        bt = torch.arange(blocks, dtype=torch.int32, device=c.device)[None]
        ctx = self.context(pos, pos.clone(), bt, [tokens], [tokens])
        self.forward(ids, pos, ctx, torch.tensor([tokens - 1], device=c.device))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        self.kv_caches = []
        self.attention.bind(self.model, [], self.kv_spec)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        current = torch.cuda.memory_allocated()
        budget = total * gpu_memory_utilization - (total - free) - (peak - current)
        num_blocks = int(budget // self.bytes_per_block())
        if num_blocks <= 0:
            from dsquant.errors import DsquantError
            raise DsquantError(f"no GPU memory left for the KV cache at gpu_memory_utilization "
                               f"{gpu_memory_utilization} (peak step {peak / 2**30:.1f} GiB of {total / 2**30:.1f})")
        return num_blocks

    def capture_cuda_graphs(self) -> None:
        if self.config.device.type != "cuda" or self.config.enforce_eager:
            return
        from dsquant.runtime.engine.cuda_graph import DecodeGraphs

        try:
            self.graphs = DecodeGraphs(self, self.config.cuda_graph_max_batch)
            self.graphs.capture()
        except Exception as e:  # a kernel that cannot be captured: stay eager, say so
            log.warning("CUDA graph capture failed, decoding eagerly: %s", e, exc_info=True)
            self.graphs = None

    # ------------------------------------------------------------------ one step
    def context(self, positions, slot_mapping, block_tables, q_lens, seq_lens) -> PagedContext:
        """The attention context of one forward: positions [T], slot_mapping [T], block_tables
        [B, W] on the device, host lists q_lens / seq_lens (torch.tensor each: off the step path).
        Public for the tensor-parallel workers, which replay rank 0's step (parallel/worker.py)."""
        device = self.config.device
        cu = _cu_seqlens(q_lens)
        return self._paged_context(positions, slot_mapping, block_tables,
                                   torch.tensor(seq_lens, dtype=torch.int32, device=device),
                                   torch.tensor(cu, dtype=torch.int32, device=device), q_lens, seq_lens)

    def _paged_context(self, positions, slot_mapping, block_tables, seq_lens_t, cu_seqlens_q,
                       q_lens: list[int], seq_lens: list[int]) -> PagedContext:
        cos, sin = self.model.rope_cos_sin(positions[None])  # [1, T, rot/2]
        return PagedContext(
            cos=cos, sin=sin, slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens_t,
            cu_seqlens_q=cu_seqlens_q, max_q_len=max(q_lens), max_seq_len=max(seq_lens),
            is_decode=all(n == 1 for n in q_lens), q_lens_host=list(q_lens), seq_lens_host=list(seq_lens))

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The step's inputs on the device, in one host -> device copy (packed_copy.py); a decode
        batch the CUDA graphs take is written straight into their static buffers, with no rope
        cos/sin here (the graph computes them)."""
        bs = self.config.block_size
        input_ids, positions, slots, q_lens, seq_lens, rows = [], [], [], [], [], []
        sampling, samples, spans, span_rows = [], batch.samples(), [], []
        fill_rows, fill_src = [], []  # placeholder input ids and their rows in batch.prev_tokens
        for seq, n, samp in zip(batch.seqs, batch.num_new_tokens, samples):
            start = seq.num_computed_tokens
            # position p's logits score prompt token p + 1; the last prompt position is the sampled row
            count = min(start + n, seq.num_prompt_tokens - 1) - start
            if seq.prompt_logprobs is not None and count > 0:
                spans.append((seq, start, count))
                span_rows += range(len(input_ids), len(input_ids) + count)
            table = seq.block_table
            if n == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids += seq.token_ids[start:start + n]
                positions += range(start, start + n)
                slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            q_lens.append(n)
            seq_lens.append(start + n)
            if samp:
                rows.append(len(input_ids) - 1)
                sampling.append(seq)
                if seq.token_ids[-1] < 0:  # only a sampling row's last input can be a placeholder
                    fill_rows.append(len(input_ids) - 1)
                    fill_src.append(-1 - seq.token_ids[-1])
        arrays = [s.block_table_array() for s in batch.seqs]
        width = max(a.shape[0] for a in arrays)
        table = np.zeros((len(arrays), width), dtype=np.int32)  # [n, width], rows padded with block 0
        for row, a in zip(table, arrays):
            row[:a.shape[0]] = a
        table = table.reshape(-1)
        vocab = self.cfg.vocab_size
        i64, i32 = torch.int64, torch.int32
        extra = SamplingTensors.host_fields(sampling, vocab)
        # rows 0..k-1 filled from prev_tokens rows 0..k-1 (steady decoding) need no index fields
        in_order = not fill_rows or (fill_rows == fill_src and fill_rows[-1] == len(fill_rows) - 1)
        if not in_order:
            extra = [(fill_rows, i64), (fill_src, i64)] + extra
        n_tokens, g = len(input_ids), self.graphs
        if (g is not None and not spans and n_tokens == len(batch.seqs) == len(sampling)
                and n_tokens <= g.max_batch):
            samp = g.stage(self.packed, input_ids, positions, slots, seq_lens, table, width, extra)
            if fill_rows:
                samp = fill_placeholders(g.input_ids, len(fill_rows), in_order, samp, batch.prev_tokens)
            return StepInputs(g.input_ids[:n_tokens], g.positions[:n_tokens], None, g.rows[:n_tokens], sampling,
                              sampling=SamplingTensors.build(sampling, vocab, samp), graph=True)
        cu = _cu_seqlens(q_lens)
        ids_t, pos_t, slots_t, rows_t, seq_lens_t, cu_t, table_t, *samp = self.packed.pack(
            [(input_ids, i64), (positions, i64), (slots, i64), (rows + span_rows, i64),
             (seq_lens, i32), (cu, i32), (table, i32)] + extra)
        if fill_rows:
            samp = fill_placeholders(ids_t, len(fill_rows), in_order, samp, batch.prev_tokens)
        ctx = self._paged_context(pos_t, slots_t, table_t.view(len(batch.seqs), width), seq_lens_t, cu_t,
                                  q_lens, seq_lens)
        return StepInputs(ids_t, pos_t, ctx, rows_t, sampling, spans, SamplingTensors.build(sampling, vocab, samp))

    def announce(self, inputs: StepInputs) -> None:
        """Before an eager forward outside a scheduled step: nothing here (parallel.worker.DriverRunner
        sends the step to its workers, which run the same forward and its collectives)."""

    @torch.inference_mode()
    def window_logits(self, ids: list[int], block_table: list[int]) -> torch.Tensor:
        """Logits [L, vocab] of every position of one L-token sequence run as a single prefill from
        position 0, its keys and values written to the blocks `block_table` (the caller's, holding L
        tokens): a full-sequence forward through the serving path, on every tensor-parallel rank
        (`dsquant validate --tensor-parallel-size`)."""
        dev, bs, n = self.config.device, self.config.block_size, len(ids)
        if n == 0 or len(block_table) * bs < n:
            raise ValueError(f"window_logits: {n} tokens need {-(-n // bs)} blocks, got {len(block_table)}")
        i64 = torch.int64
        pos = torch.arange(n, dtype=i64, device=dev)  # [L]
        slots = torch.tensor([block_table[p // bs] * bs + p % bs for p in range(n)], dtype=i64, device=dev)
        table = torch.tensor([block_table], dtype=torch.int32, device=dev)  # [1, W]
        inputs = StepInputs(torch.tensor(ids, dtype=i64, device=dev), pos,
                            self.context(pos, slots, table, [n], [n]), pos.clone(), [])
        self.announce(inputs)
        return self.forward(inputs.input_ids, inputs.positions, inputs.ctx, inputs.logits_indices)

    def forward(self, input_ids, positions, ctx, logits_indices) -> torch.Tensor:
        """input_ids, positions [T] (the batch's tokens, flattened), ctx from `context` -> the logits
        [S, vocab] of rows logits_indices [S]; the CUDA graphs capture this call (cuda_graph.py)."""
        hidden = self.model.embed(input_ids[None])  # [1, T, hidden]
        for layer in self.model.model.layers:
            hidden = layer(hidden, ctx)
        return self.model.logits(hidden[0, logits_indices])  # [S, vocab]

    def execute(self, batch: ScheduledBatch) -> list[int]:
        """Run one step; return the new token of each sampling sequence, in batch order."""
        tokens = self.launch(batch)
        return [] if tokens is None else tokens.tolist()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, steps: int = 1) -> SampledTokens | None:
        """Queue one step up to its sampled tokens (each sampling sequence's, in batch order) and
        their copy to the host; None when no sequence samples. Logprobs, when asked for, are read
        back here (a sync). steps > 1: a burst of that many decode steps (multi_step.py), its tokens
        [steps * S], step-major."""
        inputs = self.prepare(batch)
        inputs.penalties = PenaltyTensors.from_seqs(inputs.sampling_seqs, self.cfg.vocab_size, self.config.device)
        rec = self.step_times.current if self.step_times is not None else None
        gpu = None
        if rec is not None and self.config.device.type == "cuda":
            gpu = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            gpu[0].record()
        tokens, logits = self._forward_sample(inputs)
        if tokens is None:
            return None
        n_sample = len(inputs.sampling_seqs)
        if steps > 1:
            tokens = run_burst(self, inputs, tokens, steps)
        if rec is not None:
            rec.rows, rec.steps = n_sample, steps
            if gpu is not None:
                gpu[1].record()
                rec.gpu = gpu
        record_sampled_logprobs(inputs.sampling_seqs, logits, tokens)
        return self.readback.start(tokens)  # the step's one device -> host read (more for logprobs)

    def _forward_sample(self, inputs: StepInputs) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One forward of `inputs` (the graph's replay when staged there) and its sampling ->
        (tokens [S] int64 or None when no row samples, the sampled rows' logits [S, vocab])."""
        greedy = None
        if inputs.graph:
            logits = self.graphs.replay(inputs.input_ids.shape[0])
            greedy = self.graphs.greedy_tokens(inputs.input_ids.shape[0])
        else:
            logits = self.forward(inputs.input_ids, inputs.positions, inputs.ctx, inputs.logits_indices)
        n_sample = len(inputs.sampling_seqs)
        if inputs.prompt_spans:
            record_prompt_logprobs(inputs.prompt_spans, logits[n_sample:])
        if not inputs.sampling_seqs:
            return None, logits
        logits = logits[:n_sample]
        # outside any CUDA graph
        return sample(logits, inputs.sampling, self.generator, inputs.penalties, greedy=greedy), logits


def _cu_seqlens(q_lens: list[int]) -> list[int]:
    """[0, q_lens[0], q_lens[0] + q_lens[1], ...]: each sequence's first row in the flat batch."""
    return [0, *itertools.accumulate(q_lens)]
