"""The bundled reference models: layout on disk, loading in transformers and dsquant, and the
figures on their model cards (recomputed here on CPU)."""
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from dsquant.assets import BUNDLED_MODELS, bundled_model_path, bundled_models, tokenizer_path
from dsquant.data import eval_tokens, load_documents, load_tokenizer, sliding_window_perplexity
from dsquant.errors import DsquantError

MB = 1_000_000


def tensor_shapes(model_dir) -> dict[str, tuple[list[int], str]]:
    shapes = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():
                tensor_slice = f.get_slice(key)
                shapes[key] = (tensor_slice.get_shape(), tensor_slice.get_dtype())
    return shapes


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(tokenizer_path())


@pytest.fixture(scope="module", params=BUNDLED_MODELS)
def reference(request):
    """(name, model dir, transformers model in float32 on CPU, eval.json)."""
    path = bundled_model_path(request.param)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, model, json.loads((path / "eval.json").read_text())


def test_both_models_are_bundled():
    assert bundled_models() == ["dsq-tiny-v3", "dsq-tiny-qwen2"]
    with pytest.raises(DsquantError, match="unknown bundled model 'dsq-huge'"):
        bundled_model_path("dsq-huge")


def test_files_and_sizes():
    v3, qwen2 = bundled_model_path("dsq-tiny-v3"), bundled_model_path("dsq-tiny-qwen2")
    v3_shards = sorted(v3.glob("*.safetensors"))
    assert len(v3_shards) >= 2 and all(p.stat().st_size <= 15 * MB for p in v3_shards)
    assert sum(p.stat().st_size for p in v3_shards) <= 24 * MB
    qwen2_shards = sorted(qwen2.glob("*.safetensors"))
    assert len(qwen2_shards) == 1 and qwen2_shards[0].stat().st_size <= 15 * MB
    for path in (v3, qwen2):
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "MODEL_CARD.md", "training.json"):
            assert (path / name).is_file(), f"{path / name} missing"
        assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("name", BUNDLED_MODELS)
def test_model_dir_tokenizer_is_the_bundled_one(name, tokenizer):
    """The tokenizer a model dir loads with tokenizes exactly as the one the model was trained with."""
    own = load_tokenizer(bundled_model_path(name))
    text = load_documents("eval_prose", None)[0][:2000] + load_documents("eval_code", None)[0][:2000]
    assert own(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert (own.bos_token_id, own.eos_token_id, own.chat_template) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.chat_template)


def test_v3_config_has_deepseek_v3_features():
    config = json.loads((bundled_model_path("dsq-tiny-v3") / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["q_lora_rank"] and config["kv_lora_rank"]
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "yarn"
    for field in ("factor", "original_max_position_embeddings", "mscale", "mscale_all_dim", "beta_fast", "beta_slow"):
        assert field in rope
    assert config["n_routed_experts"] >= 16 and config["num_experts_per_tok"] == 4
    assert config["n_shared_experts"] == 1 and config["first_k_dense_replace"] == 1
    assert config["n_group"] >= 2 and config["topk_group"] < config["n_group"]
    assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")


def test_v3_tensors_per_expert_and_linear_dims_multiple_of_128():
    config = json.loads((bundled_model_path("dsq-tiny-v3") / "config.json").read_text())
    shapes = tensor_shapes(bundled_model_path("dsq-tiny-v3"))
    assert "model.layers.0.mlp.gate_proj.weight" in shapes  # first layer dense
    for layer in range(1, config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp"
        for e in range(config["n_routed_experts"]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"{prefix}.experts.{e}.{proj}.weight" in shapes
        assert shapes[f"{prefix}.gate.e_score_correction_bias"] == ([config["n_routed_experts"]], "F32")
    assert not any(k.endswith("experts.gate_up_proj") for k in shapes)  # not transformers' fused layout
    for key, (shape, dtype) in shapes.items():
        if len(shape) != 2 or key.endswith("mlp.gate.weight"):  # the router is no Linear
            continue
        assert dtype == "BF16"
        if "kv_a_proj_with_mqa" in key:
            assert shape == [config["kv_lora_rank"] + config["qk_rope_head_dim"], config["hidden_size"]]
        else:
            assert shape[0] % 128 == 0 and shape[1] % 128 == 0, (key, shape)


def test_qwen2_tensors_gqa_with_qkv_bias():
    config = json.loads((bundled_model_path("dsq-tiny-qwen2") / "config.json").read_text())
    shapes = tensor_shapes(bundled_model_path("dsq-tiny-qwen2"))
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv_out = config["num_key_value_heads"] * head_dim
    assert shapes["model.layers.0.self_attn.k_proj.weight"][0] == [kv_out, config["hidden_size"]]
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.0.self_attn.{proj}.bias" in shapes
    for key, (shape, _) in shapes.items():
        if len(shape) == 2:
            assert shape[0] % 128 == 0 and shape[1] % 128 == 0, (key, shape)


def test_logits_equal_in_transformers_and_dsquant(reference, tokenizer):
    load_model = pytest.importorskip("dsquant.models").load_model
    name, path, model, _ = reference
    input_ids = torch.stack([eval_tokens(tokenizer, "eval_prose")[:256], eval_tokens(tokenizer, "eval_code")[:256]])
    ours = load_model(path, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        expected = model(input_ids=input_ids, use_cache=False).logits  # [2, 256, V]
        got = ours(input_ids)
    assert got.shape == expected.shape
    assert (got.float() - expected).abs().max().item() <= 1e-3


@pytest.mark.parametrize("eval_set", ["eval_prose", "eval_code"])
def test_slice_perplexity_reproduces_the_card(reference, tokenizer, eval_set):
    name, path, model, card = reference
    tokens = eval_tokens(tokenizer, eval_set)[: card["slice_tokens"]]

    def logits_fn(input_ids):
        return model(input_ids=input_ids, use_cache=False).logits

    with torch.no_grad():
        ppl = sliding_window_perplexity(logits_fn, tokens, card["window"], card["stride"], batch_size=8)
    expected = card["sets"][eval_set]["slice_perplexity"]
    assert ppl.value == pytest.approx(expected, rel=0.01)
    assert f"{expected:.4f}" in (path / "MODEL_CARD.md").read_text()


def test_card_perplexity_far_below_unigram(reference):
    name, path, _, card = reference
    text = (path / "MODEL_CARD.md").read_text()
    for eval_set, r in card["sets"].items():
        assert r["perplexity"] * 5 < r["unigram_own_perplexity"] < r["unigram_train_perplexity"]
        assert f"| {eval_set} | {r['tokens']:,} | {r['perplexity']:.2f} |" in text


def test_v3_router_has_not_collapsed(tokenizer):
    path = bundled_model_path("dsq-tiny-v3")
    card = json.loads((path / "eval.json").read_text())
    # On the card: over prose and code together, every expert of every MoE layer gets at least
    # a quarter of the mean load.
    prose, code = (card["sets"][s]["expert_loads"] for s in ("eval_prose", "eval_code"))
    for layer in prose:
        combined = torch.tensor(prose[layer]) + torch.tensor(code[layer])
        assert combined.min().item() >= 0.25 * combined.float().mean().item(), (layer, combined.tolist())
    # Live, on 2048 tokens of prose and code: every expert of every MoE layer gets tokens, none
    # more than 15% of them.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    counts = [torch.zeros(r.num_experts, dtype=torch.long) for r in routers]

    def counter(c):
        def hook(module, inputs, output):  # output: (router_logits, topk_weights, topk_indices)
            c.add_(torch.bincount(output[2].flatten(), minlength=module.num_experts))
        return hook

    handles = [r.register_forward_hook(counter(c)) for r, c in zip(routers, counts)]
    input_ids = torch.cat([eval_tokens(tokenizer, s)[:1024].view(2, 512) for s in ("eval_prose", "eval_code")])
    with torch.no_grad():
        model(input_ids=input_ids, use_cache=False)
    for h in handles:
        h.remove()
    for c in counts:
        assert (c > 0).all() and c.max().item() < 0.15 * c.sum().item(), c.tolist()  # balanced: 1/16
