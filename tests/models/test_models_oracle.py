"""dsquant's model code against transformers ("the oracle"), logit for logit, in float32.

Each case builds a random tiny model of one architecture in transformers (bench.random_model's
random_hf_model), saves it with save_pretrained, loads the directory with dsquant and compares
logits on random token batches.
Weights are re-drawn with a large spread (std 0.15) and the V3 correction bias is random, so
routing decisions, group selection and rope positions all matter to the result.
"""
import pytest
import torch

from dsquant.bench.random_model import random_hf_model
from dsquant.models import load_model

TOL = 1e-4
VOCAB = 320

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6)
MLA = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
           moe_intermediate_size=32, num_key_value_heads=4)

CASES = {  # case -> config.json-style dict (architectures names the transformers class)
    # V2-Lite style: no q LoRA, softmax + greedy, 2 shared experts, first layer dense
    "v2_lite_greedy": dict(
        architectures=["DeepseekV2ForCausalLM"], **COMMON, **MLA, q_lora_rank=None, n_routed_experts=8,
        n_shared_experts=2, num_experts_per_tok=3, first_k_dense_replace=1, topk_method="greedy",
        norm_topk_prob=False, routed_scaling_factor=1.0),
    # V2 with device-limited routing and YaRN
    "v2_group_limited_yarn": dict(
        architectures=["DeepseekV2ForCausalLM"], **COMMON, **MLA, q_lora_rank=48, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=16.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                         "original_max_position_embeddings": 64, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
    # V3 style: q LoRA, sigmoid + noaux_tc with grouped top-k, YaRN with mscale, dense first layer
    "v3_noaux_tc_yarn": dict(
        architectures=["DeepseekV3ForCausalLM"], **COMMON, **MLA, q_lora_rank=48, n_routed_experts=16,
        n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 32, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    # V3 with plain (non-interleaved) rope layout
    "v3_rope_not_interleaved": dict(
        architectures=["DeepseekV3ForCausalLM"], **COMMON, **MLA, q_lora_rank=48, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=2, n_group=2, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=1.0, rope_interleave=False),
    "llama_gqa": dict(
        architectures=["LlamaForCausalLM"], **COMMON, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "llama3_rope_scaling": dict(
        architectures=["LlamaForCausalLM"], **COMMON, num_key_value_heads=1, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2_bias_tied": dict(
        architectures=["Qwen2ForCausalLM"], **COMMON, num_key_value_heads=2, tie_word_embeddings=True),
}


def build_reference(case: str, seed: int = 0):
    """The case's random transformers model (std 0.15, random norms and V3 correction bias)."""
    return random_hf_model(CASES[case], seed)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    ref = build_reference(case)
    ref.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 40), generator=gen)
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours(ids)
    assert expected.std() > 0.5, "logits too flat for the comparison to mean anything"
    assert torch.isfinite(got).all()
    assert (got - expected).abs().max().item() <= TOL


def test_routing_exercises_many_experts(tmp_path):
    """The V3 oracle case routes tokens to most experts, so a routing bug could not hide."""
    ref = build_reference("v3_noaux_tc_yarn")
    ref.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    seen = set()

    def hook(module, args, output):
        seen.update(output[1].flatten().tolist())

    handle = ours.model.layers[1].mlp.gate.register_forward_hook(hook)
    with torch.no_grad():
        ours(torch.randint(0, VOCAB, (2, 64)))
    handle.remove()
    assert len(seen) >= 12


def test_padded_batch_matches_unpadded(tmp_path):
    """A left-padded sequence in a batch gives the same logits as when it runs alone."""
    build_reference("qwen2_bias_tied").save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    short = torch.randint(0, VOCAB, (1, 9))
    long = torch.randint(0, VOCAB, (1, 14))
    batch = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch, dtype=torch.bool)
    mask[0, :5] = False
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        alone = ours(short)
        batched = ours(batch, positions=positions, attention_mask=mask)
    assert (batched[0, 5:] - alone[0]).abs().max().item() <= TOL
