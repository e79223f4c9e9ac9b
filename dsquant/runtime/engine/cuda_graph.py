"""CUDA graphs for decode steps, one per bucketed batch size (1, 2, 4, 8, then steps of 8).

Static buffers hold the step's inputs; a batch of n decodes is padded to the next bucket with
rows that store nothing (slot -1) and attend to nothing (seq_len 0, so the kernels write zeros).
The attention kernels are launched with max_seq_len = max_model_len so one capture serves
every context length. Logits of the first n rows are returned; sampling runs outside the graph.
"""
from __future__ import annotations

import torch

from dsquant.runtime.layers.attention import PagedContext


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 8))
    return sizes


class DecodeGraphs:
    def __init__(self, runner, max_batch: int):
        self.runner = runner
        self.sizes = bucket_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        c, dev = runner.config, runner.config.device
        max_blocks = -(-c.max_model_len // c.block_size)
        b = self.max_batch
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(b, max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.rows = torch.arange(b, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _run_model(self, n: int) -> torch.Tensor:
        r = self.runner
        cos, sin = r.model.rope_cos_sin(self.positions[None, :n])
        ctx = PagedContext(cos=cos, sin=sin, slot_mapping=self.slot_mapping[:n],
                           block_tables=self.block_tables[:n], seq_lens=self.seq_lens[:n],
                           cu_seqlens_q=self.cu_seqlens_q[:n + 1], max_q_len=1,
                           max_seq_len=r.config.max_model_len, is_decode=True)
        return r._forward(self.input_ids[:n], self.positions[:n], ctx, self.rows[:n])

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for n in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            self._run_model(n)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[n] = self._run_model(n)
            pool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize()

    def can_run(self, inputs) -> bool:
        n = inputs.input_ids.shape[0]
        return inputs.ctx.is_decode and n <= self.max_batch and len(inputs.sampling_seqs) == n

    def run(self, inputs) -> torch.Tensor:
        n = inputs.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        ctx = inputs.ctx
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:n].copy_(ctx.slot_mapping)
        self.seq_lens.zero_()
        self.seq_lens[:n].copy_(ctx.seq_lens)
        self.block_tables[:n, :ctx.block_tables.shape[1]].copy_(ctx.block_tables)
        self.graphs[size].replay()
        return self.outputs[size][:n]
