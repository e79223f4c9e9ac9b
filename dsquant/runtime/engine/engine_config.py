"""EngineConfig: how an LLMEngine (and the model builder under it) runs a checkpoint."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EngineConfig:
    device: str | None = None  # None: cuda when available
    dtype: torch.dtype | None = None  # None: the checkpoint's float dtype
    block_size: int = 16
    num_blocks: int | None = None  # None: CUDA profiles; CPU divides kv_cache_memory
    kv_cache_memory: int = 256 << 20  # CPU KV budget in bytes
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # > 0: a prefill chunk beside decodes is capped at it (scheduler.py)
    max_model_len: int | None = None  # None: config's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    cuda_graph_max_batch: int = 64
    verify_checksums: bool = True
    seed: int = 0
    tokenizer: str | None = None  # a directory with tokenizer.json; None: the model's
    tensor_parallel_size: int = 1  # processes, one per GPU (gloo processes on CPU); runtime/parallel
    kernels: bool | None = None  # Triton attention, fused MoE and quantized GEMMs; None: on CUDA (False: pure torch
    # everywhere, the reference path; True on CPU runs attention/MoE under TRITON_INTERPRET=1)
    kv_cache_dtype: str = "auto"  # "auto": the model dtype; "fp8": e4m3 with per-token scales (layers/kv_cache.py)
    async_scheduling: bool = True  # launch step N + 1 before reading step N's tokens (async_step.py);
    # off under tensor parallelism. H200, V2-Lite shape: batch-1 decode +8-12%, 64 concurrent +14-18%
    num_scheduler_steps: int = 1  # > 1: decode batches run up to this many steps per launch (multi_step.py);
    # off under tensor parallelism
