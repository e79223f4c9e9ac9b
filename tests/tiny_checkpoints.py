"""A tiny random DeepSeek-V3 checkpoint for the quantize / validate tests (CPU-sized, in transformers).

Built by bench.random_model.random_hf_model, the one builder of random transformers models: std 0.04,
norms and the routing correction bias left at transformers' ones / zeros (seed 0).
"""
from pathlib import Path

import torch

from dsquant.bench.random_model import copy_tokenizer, random_hf_model

TINY_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"], vocab_size=8192, hidden_size=128, intermediate_size=256,
    moe_intermediate_size=128, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
    q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    first_k_dense_replace=1, max_position_embeddings=1024)


def write_tiny_v3(path, kv_lora_rank=128, v_head_dim=64, dead_expert=None, **overrides) -> Path:
    """overrides: other DeepseekV3Config fields (e.g. q_lora_rank, intermediate_size). dead_expert:
    an expert whose correction bias (-100) keeps the router from ever picking it."""
    config = {**TINY_V3, "kv_lora_rank": kv_lora_rank, "v_head_dim": v_head_dim, **overrides}
    model = random_hf_model(config, seed=0, std=0.04, norm_std=0, bias_std=0)
    if dead_expert is not None:
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias[dead_expert] = -100.0
    path = Path(path)
    model.save_pretrained(path)
    copy_tokenizer(path)
    return path
