"""Building the served model: the backends a run asks for, the model loaded with them, its runner.

The engine (engine/llm_engine.py) and the tensor-parallel workers (parallel/launch.py, worker.py)
build through here, so the parallel code never imports the engine. What `build_runner` does:
- chooses the `Backends` (models/layers.py): with kernels on, Triton paged attention, the fused
  MoE and the kernel-path module classes (layers/fused.py: Triton RMSNorm (+ residual add),
  routing, SiLU-and-mul, MLA rope and fused MLA), so the model is built of them; else the torch
  references and the plain classes;
- the per-layer preparation that runs before each Linear repacks its checkpoint tensors (each
  backend's `prepare`: MLA's absorbed weights, experts stacked; on the kernel path the MLA input
  projections fused);
- loads the weights (runtime/loader.py: this rank's shard under tensor parallelism);
- wraps the model in its ModelRunner (CUDA graphs, KV cache).
"""
from __future__ import annotations

from pathlib import Path

import torch

from dsquant.models.layers import Backends
from dsquant.runtime.engine.engine_config import EngineConfig
from dsquant.runtime.engine.model_runner import ModelRunner, RunnerConfig


def build_runner(path: Path, c: EngineConfig, device: torch.device, reader=None, parallel=None,
                 runner_cls=ModelRunner) -> ModelRunner:
    """Load the model (this rank's shard when `parallel`, a ParallelState, has world size > 1) with
    the attention / MoE backends `c` asks for, and its runner (`runner.model`)."""
    from dsquant.runtime.layers.fused_linear import fuse_mla_input_projections
    from dsquant.runtime.loader import load_runtime_model

    use_kernels = c.kernels if c.kernels is not None else device.type == "cuda"
    # q_proj is split by heads under tensor parallelism, kv_a is not: their GEMMs stay apart there
    fuse_projections = use_kernels and not (parallel is not None and parallel.world_size > 1)
    if use_kernels:
        from dsquant.runtime.layers import fused
        from dsquant.runtime.layers.attention_triton import TritonPagedAttention
        from dsquant.runtime.layers.moe import FusedMoE

        # Triton kernels on CUDA tensors; on CPU under TRITON_INTERPRET, else the torch forward
        backends = Backends(attention=TritonPagedAttention(), moe=FusedMoE(), norm_cls=fused.TritonRMSNorm,
                            mlp_cls=fused.TritonGatedMLP, router_cls=fused.TritonRouter, moe_cls=fused.TritonMoE,
                            mla_cls=fused.TritonMLAttention, decoder_layer_cls=fused.FusedAddNormDecoderLayer)
    else:
        from dsquant.runtime.layers.attention import TorchPagedAttention
        from dsquant.runtime.layers.moe import LoopMoE

        backends = Backends(attention=TorchPagedAttention(), moe=LoopMoE())
    attention, moe = backends.attention, backends.moe

    def prepare(decoder_layer):  # before each Linear repacks (and drops) its checkpoint tensors
        attention.prepare(decoder_layer)
        moe.prepare(decoder_layer)
        if fuse_projections:
            fuse_mla_input_projections(decoder_layer)

    model = load_runtime_model(path, backends, c.dtype, device, verify=c.verify_checksums, prepare_layer=prepare,
                               kernels=use_kernels, reader=reader, parallel=parallel)
    dtype = next(model.parameters()).dtype if c.dtype is None else c.dtype
    max_model_len = c.max_model_len or model.config.max_position_embeddings
    return runner_cls(model, attention, RunnerConfig(
        device=device, dtype=dtype, block_size=c.block_size, max_model_len=max_model_len,
        max_num_batched_tokens=c.max_num_batched_tokens, enforce_eager=c.enforce_eager,
        cuda_graph_max_batch=min(c.cuda_graph_max_batch, c.max_num_seqs), kv_cache_dtype=c.kv_cache_dtype,
        num_scheduler_steps=c.num_scheduler_steps if c.tensor_parallel_size == 1 else 1), seed=c.seed)
