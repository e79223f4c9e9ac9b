"""Per-layer streaming: materialise one decoder layer at a time, as calibration does.

Running the layers one by one, each loaded just before and released just after, must give the
same logits as the whole model loaded at once, with at most one layer off the meta device.
"""
import torch
import transformers

from dsquant.models import load_model, open_model
from dsquant.models.loader import check_unexpected, load_layer, release_layer


def test_layer_by_layer_equals_whole_model(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=128)
    ref = transformers.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
    ref.save_pretrained(tmp_path, max_shard_size="30KB")

    ids = torch.randint(0, 96, (2, 12))
    whole = load_model(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        expected = whole(ids)

    model, source = open_model(tmp_path)
    load_layer(model, source, None, "cpu", torch.float32)
    positions = torch.arange(12).expand(2, 12)
    ctx = model.eager_context(positions)
    with torch.no_grad():
        hidden = model.embed(ids)
        for i, layer in enumerate(model.model.layers):
            load_layer(model, source, i, "cpu", torch.float32)
            on_device = [j for j, lyr in enumerate(model.model.layers)
                         if any(not p.is_meta for p in lyr.parameters())]
            assert on_device == [i]
            hidden = layer(hidden, ctx)
            release_layer(model, i)
        got = model.logits(hidden)
    check_unexpected(model, source)
    assert (got - expected).abs().max().item() <= 1e-5
