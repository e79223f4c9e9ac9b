"""Tensor parallelism builds each rank's shard directly (runtime/parallel/model.py): the model a
rank constructs already has its local shapes, heads, experts and embedding rows, and every tensor
it declares is served, in that shape, by the plan's reader. Nothing changes the model afterwards.
"""
from __future__ import annotations

import pytest
import torch

from dsquant.assets import bundled_model_path
from dsquant.config import load_config
from dsquant.models.causal_lm import CausalLM
from dsquant.models.checkpoint import CheckpointReader
from dsquant.models.layers import Backends
from dsquant.models.moe import MoE
from dsquant.runtime.layers.linear import LinearFactory
from dsquant.runtime.parallel.model import VocabParallelEmbedding, tensor_parallel_backends
from dsquant.runtime.parallel.moe import ExpertParallel
from dsquant.runtime.parallel.state import ParallelState


def build_rank(name: str, rank: int, world: int = 2):
    path = bundled_model_path(name)
    cfg, reader = load_config(path), CheckpointReader(path)
    factory = LinearFactory(cfg.quantization_config, reader, kernels=False, source=cfg.quantization_source)
    backends, plan = tensor_parallel_backends(Backends(linear=factory), cfg, reader, ParallelState(rank, world))
    return cfg, CausalLM(cfg, backends), plan.reader()


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("name", ["dsq-tiny-v3", "dsq-tiny-qwen2"])
def test_each_rank_constructs_its_shard_and_the_reader_serves_every_tensor_in_its_shape(name, rank):
    cfg, model, reader = build_rank(name, rank)
    h = cfg.num_attention_heads
    assert model.config.num_attention_heads == h // 2
    if not cfg.is_deepseek:
        assert model.config.num_key_value_heads == cfg.num_key_value_heads // 2
    for layer in model.model.layers:
        attn = layer.self_attn
        assert attn.num_heads == h // 2
        assert attn.o_proj.in_features * 2 == h * (
            cfg.v_head_dim if cfg.is_deepseek else cfg.dense_head_dim)
        if isinstance(layer.mlp, MoE):
            held = [i for i, e in enumerate(layer.mlp.experts) if e is not None]
            per = cfg.n_routed_experts // 2
            assert held == list(range(rank * per, (rank + 1) * per))
            assert isinstance(layer.mlp.backend, ExpertParallel)
            assert (layer.mlp.backend.start, layer.mlp.backend.stop) == (rank * per, (rank + 1) * per)
        else:
            assert layer.mlp.gate_proj.out_features * 2 == cfg.intermediate_size
    embed = model.model.embed_tokens
    assert isinstance(embed, VocabParallelEmbedding)
    per = -(-cfg.vocab_size // 2)
    assert (embed.part.start, embed.part.stop) == (rank * per, min(cfg.vocab_size, (rank + 1) * per))

    declared = {f"{m}.{p}" if m else p: t.shape for m, mod in model.named_modules()
                for p, t in list(mod._parameters.items()) + list(mod._buffers.items()) if t is not None}
    served = set()
    for key, shape in declared.items():
        if key == "lm_head.weight" and key not in reader and cfg.tie_word_embeddings:
            key = "model.embed_tokens.weight"  # tied: the loader reads the embedding's rows
        assert key in reader, key
        assert reader.get(key).shape == shape, key
        served.add(key)
    # nothing the rank does not build is left for it to read (other ranks' experts are hidden)
    assert set(reader.keys()) <= served | set(reader.rules), sorted(set(reader.keys()) - served)[:5]


def test_the_ranks_shards_of_a_column_parallel_weight_tile_the_checkpoints():
    full = CheckpointReader(bundled_model_path("dsq-tiny-qwen2"))
    key = "model.layers.0.self_attn.q_proj.weight"
    parts = [build_rank("dsq-tiny-qwen2", r)[2].get(key) for r in (0, 1)]
    assert torch.equal(torch.cat(parts, 0), full.get(key).to(parts[0].dtype))
