"""`dsquant quantize` end to end on a tiny random DeepSeek-V3 checkpoint (CPU).

Checks that every bundled recipe writes an artifact that dsquant inspects and loads, that the
manifest's shard hashes match, that the compressed-tensors library decompresses the mixed
artifact to dsquant's weights, that transformers loads the FP8 artifact to the same weights,
that an interrupted run resumes to identical shards, that an expert the router never picks is
still calibrated, and that bad recipes fail before any work.
"""
import hashlib
import json
import re

import pytest
import torch
import transformers
from safetensors import safe_open

from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize
from dsquant.calibrate.recipe import bundled_recipes
from dsquant.errors import ConfigError, DsquantError
from dsquant.models import load_model
from dsquant.models.summary import summarize
from tests.tiny_checkpoints import write_tiny_v3

RECIPES = [r[: -len(".yaml")] for r in bundled_recipes()]
EXPECTED_FORMAT = {"awq-w4g128": "awq", "rtn-w4g128": "awq", "gptq-w4g128": "gptq",
                   "fp8-block": "fp8", "mixed-fp8attn-w4experts": "compressed-tensors"}


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory):
    return write_tiny_v3(tmp_path_factory.mktemp("tiny_v3"))


def quantize(model_dir, recipe, out, **kw):
    return run_quantize(QuantizeArgs(str(model_dir), recipe, str(out), n_samples=4, seqlen=64, **kw))


@pytest.fixture(scope="module")
def artifacts(tiny_v3, tmp_path_factory):
    root = tmp_path_factory.mktemp("artifacts")
    return {r: quantize(tiny_v3, r, root / r) for r in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_writes_a_loadable_artifact(recipe, artifacts, tiny_v3):
    report = artifacts[recipe]
    out = report.out_dir
    assert not out.with_name(out.name + ".partial").exists()
    config = json.loads((out / "config.json").read_text())
    assert report.manifest["format"] == EXPECTED_FORMAT[recipe]
    assert config["quantization_config"]["quant_method"] == {"compressed-tensors": "compressed-tensors"}.get(
        EXPECTED_FORMAT[recipe], EXPECTED_FORMAT[recipe])
    for shard, digest in report.manifest["shards"].items():
        assert hashlib.sha256((out / shard).read_bytes()).hexdigest() == digest
    summary = summarize(out)
    assert summary.quantized_types()
    assert "lm_head" in summary.kept_types() and "mlp.gate" in summary.kept_types()
    ours = load_model(out, dtype=torch.float32)
    base = load_model(tiny_v3, dtype=torch.float32)
    ids = torch.randint(0, 8192, (2, 32))
    with torch.no_grad():
        got, ref = ours(ids), base(ids)
    rel = ((got - ref).norm() / ref.norm()).item()
    # a random MoE model amplifies weight error (routing flips); trained-model accuracy is
    # checked in test_accuracy_bundled.py
    assert torch.isfinite(got).all() and 0 < rel < (0.3 if recipe == "fp8-block" else 0.7)
    assert (out / "tokenizer.json").exists() and (out / "dsquant.json").exists()


def test_compressed_tensors_library_decompresses_mixed_artifact(artifacts):
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    out = artifacts["mixed-fp8attn-w4experts"].out_dir
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    ours = dict(load_model(out, dtype=torch.float32).named_parameters())
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    checked = {"pack-quantized": 0, "float-quantized": 0}
    for group in config["config_groups"].values():
        scheme = QuantizationScheme(**{k: v for k, v in group.items() if k != "format"}, format=group["format"])
        compressor = BaseCompressor.get_value_from_registry(group["format"])
        patterns = [re.compile(t[3:]) for t in group["targets"]]
        modules = {k.rsplit(".", 1)[0] for k in index if any(p.match(k.rsplit(".", 1)[0]) for p in patterns)}
        for module in sorted(modules):
            state = {}
            for key in (k for k in index if k.rsplit(".", 1)[0] == module):
                with safe_open(str(out / index[key]), "pt") as f:
                    state[key.rsplit(".", 1)[1]] = f.get_tensor(key)
            # fp32 scales make the library's (q - zero) * scale exact, as dsquant's is
            state["weight_scale"] = state["weight_scale"].to(torch.float32)
            dense = compressor.decompress(state, scheme)["weight"].to(torch.float32)
            assert torch.equal(dense, ours[f"{module}.weight"]), module
            checked[group["format"]] += 1
    assert checked["pack-quantized"] >= 16 and checked["float-quantized"] >= 10


def test_fp8_artifact_loads_in_transformers_with_the_same_weights(tmp_path):
    # kv_a_proj 96 + 32 = 128 rows, kv_b_proj 2 x (32 + 32) = 128 rows: every FP8 dim is whole
    # blocks or a single block, which transformers' CPU dequantization handles (it mis-sizes a
    # partial block that follows a full one)
    model_dir = write_tiny_v3(tmp_path / "model", kv_lora_rank=96, v_head_dim=32)
    out = quantize(model_dir, "fp8-block", tmp_path / "fp8").out_dir
    ours = load_model(out, dtype=torch.float32)
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref_state = ref.state_dict()
    for name, p in ours.named_parameters():
        if ".experts." not in name:
            assert torch.allclose(p, ref_state[name].float(), atol=1e-6, rtol=0), name
    ids = torch.randint(0, 8192, (2, 24))
    with torch.no_grad():
        assert (ours(ids) - ref(ids).logits).abs().max().item() <= 1e-4


def test_interrupted_run_resumes_to_identical_shards(tiny_v3, artifacts, tmp_path):
    out = tmp_path / "awq"

    def interrupt_after_first_layer(done, total, stats):
        if done == 1:
            raise KeyboardInterrupt

    args = QuantizeArgs(str(tiny_v3), "awq-w4g128", str(out), n_samples=4, seqlen=64)
    with pytest.raises(KeyboardInterrupt):
        run_quantize(args, interrupt_after_first_layer)
    assert not out.exists() and (tmp_path / "awq.partial" / "resume.json").exists()
    resumed = run_quantize(args)
    assert resumed.manifest["resumed_from_layer"] == 1
    assert resumed.manifest["shards"] == artifacts["awq-w4g128"].manifest["shards"]


def test_existing_output_is_not_overwritten_without_force(tiny_v3, artifacts):
    out = artifacts["rtn-w4g128"].out_dir
    with pytest.raises(DsquantError, match="already exists; pass --force"):
        quantize(tiny_v3, "rtn-w4g128", out)


def test_never_routed_expert_is_calibrated_on_real_tokens(tmp_path):
    model_dir = write_tiny_v3(tmp_path / "model", dead_expert=3)
    report = quantize(model_dir, "awq-w4g128", tmp_path / "awq")
    for layer in ("1", "2"):
        assert 3 in report.manifest["layers"][layer]["fallback_experts"]
    err = report.module_errors["model.layers.1.mlp.experts.3.down_proj"]
    typical = report.module_errors["model.layers.1.mlp.experts.0.down_proj"]
    assert 0 < err < 2 * typical


def test_awq_and_gptq_beat_rtn_on_output_error(artifacts):
    def mean_error(recipe):
        errs = artifacts[recipe].module_errors.values()
        return sum(errs) / len(errs)

    assert mean_error("awq-w4g128") < mean_error("rtn-w4g128")
    assert mean_error("gptq-w4g128") < mean_error("rtn-w4g128")


@pytest.mark.parametrize("text, message", [
    ("default: {scheme: awq}\nbogus: 1\n", "unknown key 'bogus'"),
    ("default: {scheme: int3}\n", "'int3' is not a scheme"),
    ("default: {scheme: awq, group_size: 100}\n", "group_size: 100"),
    ("rules: [{scheme: awq}]\ndefault: {scheme: fp8_block}\n", "rules[0].match"),
    ("default: {scheme: awq}\nawq: {grid: fast}\n", "awq.grid: expected a int"),
])
def test_bad_recipe_fails_before_any_work(text, message, tiny_v3, tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)
    with pytest.raises(ConfigError) as err:
        quantize(tiny_v3, str(recipe), tmp_path / "out")
    assert message in str(err.value) and str(recipe) in str(err.value)
    assert not (tmp_path / "out.partial").exists()


def test_group_size_not_dividing_in_features_names_the_module_under_on_indivisible_error(tmp_path):
    model_dir = write_tiny_v3(tmp_path / "model", kv_lora_rank=96)  # kv_b_proj in_features 96
    recipe = tmp_path / "strict.yaml"
    recipe.write_text("default: {scheme: awq, group_size: 128}\non_indivisible: error\n")  # as before the key
    with pytest.raises(ConfigError, match=r"does not divide in_features 96 of model\.layers\.0\.self_attn\.kv_b_proj"):
        quantize(model_dir, str(recipe), tmp_path / "out")
    assert not (tmp_path / "out.partial").exists()
