"""CUDA graphs for decode steps, one per bucketed batch size (1, 2, 4, 8, then steps of 8).

The static inputs are views of one packed int64 buffer, laid out for max_batch rows:
    input_ids [b] int64 | positions [b] int64 | slot_mapping [b] int64 | seq_lens [b] int32
followed by the block-table staging area ([n, W] int32, this step's width W) and the step's
extra fields: under async scheduling the rows of placeholder input ids and their source rows
(int64 each, when not in order), then the sampling fields. A step's host values go straight
into it in one host -> device copy (PackedCopy.pack with out=packed), and one device copy moves
the staged block table into the static block_tables [b, max_blocks]; placeholder input ids are
then filled from the previous step's tokens (model_runner.py). A batch of n decodes is padded
to the next bucket with rows that store nothing (slot -1) and attend to nothing (seq_len 0, so
the kernels write zeros). Rope
cos/sin are computed inside the graph from the static positions. The attention kernels are
launched with max_seq_len = max_model_len so one capture serves every context length. Logits of
the first n rows are returned; sampling runs outside the graph. With GREEDY_IN_GRAPH the graph also
takes each row's argmax (sampler.greedy_argmax) into a static buffer, `greedy_tokens(n)`, which
sampling uses for its greedy rows: on CUDA that argmax is two Triton launches, whose host-side cost
(tens of us a step) counts where the host sets the pace (small models). Off: on the V2-Lite shape it
bought nothing (H200, 2026-12-06, `GREEDY_GRAPH=1 TAG=greedy bash scripts/gpu.sh engineon` beside
`engine`, batch-1 tok/s: INT4 513.8 / 515.7 without, BF16 425.8 / 428.7, FP8 494.9 / 493.5), and the
tiny model's host split with it (`GREEDY_GRAPH=1 bash scripts/gpu.sh variance`) is not yet measured.
"""
from __future__ import annotations

import gc

import torch

from dsquant.runtime.engine.packed_copy import PackedCopy, layout, views
from dsquant.runtime.engine.multi_step import advance_static_inputs
from dsquant.runtime.engine.sampler import greedy_argmax
from dsquant.runtime.layers.attention import PagedContext

GREEDY_IN_GRAPH = False


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 8))
    return sizes


class DecodeGraphs:
    def __init__(self, runner, max_batch: int):
        self.runner = runner
        self.sizes = bucket_sizes(max_batch)
        self.max_batch = b = self.sizes[-1]
        self.bucket = {n: next(s for s in self.sizes if s >= n) for n in range(1, b + 1)}
        c, dev = runner.config, runner.config.device
        self.max_blocks = -(-c.max_model_len // c.block_size)
        i64, i32 = torch.int64, torch.int32
        self.fields = [(b, i64), (b, i64), (b, i64), (b, i32)]
        # room for the fixed fields, a full block table, placeholder rows / sources and sampling fields of b rows
        _, total = layout(self.fields + [(b * self.max_blocks, i32), (b, i64), (b, i64),
                                         (b, torch.float32), (b, torch.float32), (b, i32)])
        self.packed = torch.zeros(total, dtype=i64, device=dev)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = views(self.packed, self.fields)
        self.slot_mapping.fill_(-1)
        self.block_tables = torch.zeros(b, self.max_blocks, dtype=i32, device=dev)
        self.cu_seqlens_q = torch.arange(b + 1, dtype=i32, device=dev)
        self.rows = torch.arange(b, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.greedy: dict[int, torch.Tensor] = {}  # bucket -> [bucket] int64 argmax, when GREEDY_IN_GRAPH
        # multi-step bursts (multi_step.py): per bucket a second graph that first advances the static
        # inputs one step, input ids from `prev`, and ends with the argmax
        self.bursts = runner.config.num_scheduler_steps > 1
        self.prev = torch.zeros(b, dtype=i64, device=dev)  # [b]: the burst graphs' input tokens
        self.burst_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.burst_outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # logits [s, V], argmax [s]

    def _run_model(self, n: int) -> torch.Tensor:
        r = self.runner
        cos, sin = r.model.rope_cos_sin(self.positions[None, :n])
        ctx = PagedContext(cos=cos, sin=sin, slot_mapping=self.slot_mapping[:n],
                           block_tables=self.block_tables[:n], seq_lens=self.seq_lens[:n],
                           cu_seqlens_q=self.cu_seqlens_q[:n + 1], max_q_len=1,
                           max_seq_len=r.config.max_model_len, is_decode=True)
        return r.forward(self.input_ids[:n], self.positions[:n], ctx, self.rows[:n])

    @torch.inference_mode()
    def capture(self) -> None:
        # No garbage collection while capturing: freeing an earlier engine's pinned buffers makes the
        # host allocator query CUDA events, which invalidates the capture (seen on the H200 when
        # engines were built one after another in one process); collect first, then pause the GC.
        gc.collect()
        torch.cuda.synchronize()
        enabled = gc.isenabled()
        gc.disable()
        try:
            pool = None
            greedy = GREEDY_IN_GRAPH
            for n in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
                warm = self._run_model(n)  # warm-up: compiles kernels outside the capture
                if greedy:
                    greedy_argmax(warm)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[n] = self._run_model(n)
                    if greedy:
                        self.greedy[n] = greedy_argmax(self.outputs[n])  # [n] int64
                pool = graph.pool()
                self.graphs[n] = graph
                if self.bursts:  # the static buffers hold padding here (slot -1), so the warm-up advances nothing
                    self._burst_body(n)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self.burst_outputs[n] = self._burst_body(n)
                    self.burst_graphs[n] = graph
            torch.cuda.synchronize()
        finally:
            if enabled:
                gc.enable()

    def stage(self, packer: PackedCopy, input_ids: list[int], positions: list[int], slots: list[int],
              seq_lens: list[int], table: list[int], width: int, extra: list) -> list[torch.Tensor]:
        """Copy n decodes' inputs (table: [n, width] row-major) into the static buffers; return the
        device views of the `extra` fields (values, dtype) that rode along in the same copy."""
        n, pad = len(input_ids), self.max_batch - len(input_ids)
        i64, i32 = torch.int64, torch.int32
        out = packer.pack([(input_ids + [0] * pad, i64), (positions + [0] * pad, i64),
                           (slots + [-1] * pad, i64), (seq_lens + [0] * pad, i32), (table, i32)] + extra,
                          out=self.packed)
        self.block_tables[:n, :width].copy_(out[4].view(n, width))
        return out[5:]

    def greedy_tokens(self, n: int) -> torch.Tensor | None:
        """The argmax of the last replay's first n rows [n] int64 (a view of a static buffer, rewritten
        by the next replay of the same bucket), or None when the graphs do not take it."""
        g = self.greedy.get(self.bucket[n])
        return None if g is None else g[:n]

    def _burst_body(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        advance_static_inputs(self, n, self.runner.config.block_size)
        logits = self._run_model(n)
        return logits, greedy_argmax(logits)

    def replay_burst(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A burst's next step for n staged decodes, input ids from prev[:n] -> (logits [n, vocab],
        their argmax [n] int64; static buffers, rewritten by the next replay of the bucket)."""
        size = self.bucket[n]
        self.burst_graphs[size].replay()
        logits, greedy = self.burst_outputs[size]
        return logits[:n], greedy[:n]

    def replay(self, n: int) -> torch.Tensor:
        """Run the bucket graph for n staged decodes -> logits [n, vocab]."""
        size = self.bucket[n]
        self.graphs[size].replay()
        return self.outputs[size][:n]
