"""Recipes that never stop on a shape, and expert coverage made visible (issue 24, items 1 and 4).

A tiny DeepSeek-V3 whose in_features are not all multiples of 128: q_b_proj K = 80 (no group of
32, 64 or 128: BF16), kv_b_proj K = 96 (group 32), layer 0's dense down_proj K = 192 (group 64);
every other Linear K = 128. Expert 3 is never routed, so it falls back to all tokens in both MoE
layers (1 of 8 experts: over the 10% warning line).
"""
import json
import logging
import re

import pytest
import torch
import transformers
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.base import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from safetensors import safe_open

from dsquant.calibrate.cli_quantize import _summary
from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize
from dsquant.cli import main
from dsquant.errors import ConfigError
from dsquant.models import load_model
from dsquant.models.layers import Backends
from dsquant.runtime.loader import load_runtime_model
from tests.tiny_checkpoints import write_tiny_v3

FAST_AWQ = ("name: awq-fast\ndefault: {scheme: awq, bits: 4, group_size: 128}\n"
            "keep: [lm_head, '*.embed_tokens', '*.mlp.gate', '*norm']\n"
            "awq: {grid: 2, clip: false, block_loss: false}\n")
LAYERS = range(3)
EXPECTED = {**{f"model.layers.{i}.self_attn.q_b_proj": ("bf16", "does not divide in_features 80") for i in LAYERS},
            **{f"model.layers.{i}.self_attn.kv_b_proj": ("awq g32", "does not divide in_features 96") for i in LAYERS},
            "model.layers.0.mlp.down_proj": ("awq g64", "does not divide in_features 192")}
IDS = torch.randint(0, 8192, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory):
    return write_tiny_v3(tmp_path_factory.mktemp("odd") / "model", kv_lora_rank=96, dead_expert=3,
                         q_lora_rank=80, intermediate_size=192)


def quantize(model_dir, recipe, out, **kw):
    return run_quantize(QuantizeArgs(str(model_dir), recipe, str(out), n_samples=4, seqlen=64, **kw))


def write_recipe(tmp, name, text):
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def auto_run(odd_model, tmp_path_factory):
    """AWQ g128, --format auto: (report, pipeline warnings logged)."""
    tmp = tmp_path_factory.mktemp("auto")
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("dsquant.calibrate.pipeline")
    logger.addHandler(handler)
    try:
        report = quantize(odd_model, write_recipe(tmp, "awq-fast", FAST_AWQ), tmp / "out")
    finally:
        logger.removeHandler(handler)
    return report, [r.getMessage() for r in records]


def config_of(out):
    return json.loads((out / "config.json").read_text())["quantization_config"]


def index_of(out):
    return json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]


def test_manifest_names_every_fallback_and_what_it_became(auto_run):
    manifest = auto_run[0].manifest
    got = manifest["scheme_fallbacks"]
    assert set(got) == set(EXPECTED)
    for name, (to, why) in EXPECTED.items():
        assert got[name]["from"] == "awq g128" and got[name]["to"] == to and why in got[name]["reason"], name
    assert manifest["recipe"]["on_indivisible"] == "fallback"


def test_auto_format_writes_compressed_tensors_with_a_config_group_per_group_size(auto_run):
    out = auto_run[0].out_dir
    qc = config_of(out)
    assert auto_run[0].manifest["format"] == "compressed-tensors" and qc["quant_method"] == "compressed-tensors"
    groups = {g["weights"]["group_size"]: g for g in qc["config_groups"].values()}
    assert sorted(groups) == [32, 64, 128]
    index = index_of(out)
    packed = [k[: -len(".weight_packed")] for k in index if k.endswith(".weight_packed")]
    for module in packed:  # each packed module is targeted by exactly the group of its stored group size
        hits = [g for g, spec in groups.items() if any(re.match(t[3:], module) for t in spec["targets"])]
        with safe_open(str(out / index[f"{module}.weight_scale"]), "pt") as f:
            n_groups = f.get_slice(f"{module}.weight_scale").get_shape()[1]
        k = 192 if module == "model.layers.0.mlp.down_proj" else 96 if module.endswith("kv_b_proj") else 128
        assert len(hits) == 1 and n_groups * hits[0] == k, module
    assert all(f"model.layers.{i}.self_attn.q_b_proj" in qc["ignore"] for i in LAYERS)
    # the compressed-tensors library (and transformers' config class) read the config, every group
    parsed = QuantizationConfig.model_validate(qc)
    assert sorted(g.weights.group_size for g in parsed.config_groups.values()) == [32, 64, 128]
    hf = transformers.utils.quantization_config.CompressedTensorsConfig.from_dict(qc)
    compressor = ModelCompressor.from_compression_config(hf)
    assert compressor is not None and compressor.quantization_config.format == "pack-quantized"


def test_compressed_tensors_library_decompresses_the_fallback_groups(auto_run):
    out = auto_run[0].out_dir
    qc, index = config_of(out), index_of(out)
    ours = dict(load_model(out, dtype=torch.float32).named_parameters())
    by_group = {g["weights"]["group_size"]: g for g in qc["config_groups"].values()}
    for group, module in ((64, "model.layers.0.mlp.down_proj"), (32, "model.layers.1.self_attn.kv_b_proj"),
                          (128, "model.layers.1.mlp.experts.0.down_proj")):
        spec = by_group[group]
        scheme = QuantizationScheme(**{k: v for k, v in spec.items() if k != "format"}, format=spec["format"])
        state = {}
        for key in (k for k in index if k.rsplit(".", 1)[0] == module):
            with safe_open(str(out / index[key]), "pt") as f:
                state[key.rsplit(".", 1)[1]] = f.get_tensor(key)
        assert state["weight_scale"].shape[1] == ours[f"{module}.weight"].shape[1] // group, module
        state["weight_scale"] = state["weight_scale"].to(torch.float32)
        dense = BaseCompressor.get_value_from_registry(spec["format"]).decompress(state, scheme)["weight"]
        assert torch.equal(dense.to(torch.float32), ours[f"{module}.weight"]), module
    assert "model.layers.0.self_attn.q_b_proj.weight" in index  # BF16


def test_runtime_serves_the_mixed_group_artifact_with_the_reference_logits(auto_run):
    out = auto_run[0].out_dir
    runtime = load_runtime_model(out, Backends(), dtype=torch.float32)
    reference = load_model(out, dtype=torch.float32)
    with torch.no_grad():
        got, ref = runtime(IDS), reference(IDS)
    assert torch.isfinite(got).all() and torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    assert runtime.linear_methods["ct_int4"] > 0 and runtime.linear_methods["dense"] >= 3  # q_b_proj x 3
    assert runtime.model.layers[0].mlp.down_proj.method.group_size == 64
    assert runtime.model.layers[2].self_attn.kv_b_proj.method.group_size == 32


def test_explicit_awq_keeps_other_groups_bf16_by_full_name(odd_model, tmp_path):
    report = quantize(odd_model, "rtn-w4g128", tmp_path / "awq", format="awq")
    out, fallbacks = report.out_dir, report.manifest["scheme_fallbacks"]
    qc, index = config_of(out), index_of(out)
    assert qc["quant_method"] == "awq" and qc["group_size"] == 128
    for name in EXPECTED:
        assert fallbacks[name]["to"] == "bf16" and name in qc["modules_to_not_convert"], name
        assert f"{name}.weight" in index and f"{name}.qweight" not in index
    assert "--format awq holds one group size (128)" in fallbacks["model.layers.0.mlp.down_proj"]["reason"]
    assert "mlp.down_proj" not in qc["modules_to_not_convert"]  # full names only: no other layer skipped
    assert "model.layers.1.mlp.experts.0.down_proj.qweight" in index
    assert transformers.AwqConfig.from_dict(qc).modules_to_not_convert == qc["modules_to_not_convert"]
    runtime = load_runtime_model(out, Backends(), dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(runtime(IDS), load_model(out, dtype=torch.float32)(IDS), atol=1e-4, rtol=1e-4)
    assert runtime.model.layers[1].self_attn.kv_b_proj.method.name == "dense"


def test_on_indivisible_keep_leaves_them_bf16_in_one_group_awq(odd_model, tmp_path):
    recipe = write_recipe(tmp_path, "keep", "default: {scheme: rtn, group_size: 128}\non_indivisible: keep\n"
                          "keep: [lm_head, '*.embed_tokens', '*.mlp.gate', '*norm']\n")
    report = quantize(odd_model, recipe, tmp_path / "out")
    assert report.manifest["format"] == "awq" and config_of(report.out_dir)["group_size"] == 128
    assert {n: f["to"] for n, f in report.manifest["scheme_fallbacks"].items()} == {n: "bf16" for n in EXPECTED}


def test_on_indivisible_error_stops_before_any_work(odd_model, tmp_path):
    recipe = write_recipe(tmp_path, "strict", "default: {scheme: awq, group_size: 128}\non_indivisible: error\n")
    with pytest.raises(ConfigError, match=r"strict\.yaml: group_size 128 does not divide in_features 80 of "
                                          r"model\.layers\.0\.self_attn\.q_b_proj \(on_indivisible: error"):
        quantize(odd_model, recipe, tmp_path / "out")
    assert not (tmp_path / "out.partial").exists()


def test_manifest_counts_every_routed_token_per_expert(auto_run):
    layers = auto_run[0].manifest["layers"]
    assert "expert_tokens" not in layers["0"]  # dense
    for k in ("1", "2"):
        cov = layers[k]["expert_tokens"]
        assert cov["n_experts"] == 8 and cov["min"] == 0 and 3 in layers[k]["fallback_experts"]
        assert cov["n_fallback"] == len(layers[k]["fallback_experts"]) >= 1
        counts = cov["counts"]
        assert sum(counts) == 4 * 64 * 2  # top-2 routing of 4 x 64 tokens: every routed token counted once
        assert counts[3] == 0 and (cov["min"], cov["max"]) == (min(counts), max(counts))
        assert cov["median"] == sorted(counts)[3] / 2 + sorted(counts)[4] / 2
        assert set(layers[k]["fallback_experts"]) >= {e for e, c in enumerate(counts) if c < 32}


def test_summary_and_inspect_show_fallbacks_coverage_and_the_warning(auto_run, capsys):
    report, logged = auto_run
    text = _summary(report)
    assert "modules not on their recipe scheme (7, recipe on_indivisible: fallback):" in text
    assert "awq g128 -> awq g64: model.layers.0.mlp.down_proj (group_size 128 does not divide in_features 192)" in text
    assert "awq g128 -> awq g32: model.layers.{0-2}.self_attn.kv_b_proj" in text
    assert "awq g128 -> bf16: model.layers.{0-2}.self_attn.q_b_proj" in text
    assert "  layer 1: 8 experts, tokens min 0 / median" in text
    warnings = [line for line in text.splitlines() if line.startswith("warning: layer ")]
    assert len(warnings) == 2 and all("raise --n-samples" in w for w in warnings)
    assert len([m for m in logged if "raise --n-samples" in m]) == 2  # logging.warning, once per layer
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", str(report.out_dir)])
    printed = capsys.readouterr().out
    assert exit_.value.code == 0
    for line in ("awq g128 -> awq g64: model.layers.0.mlp.down_proj", "expert coverage", "layer 2: 8 experts",
                 warnings[0]):
        assert line in printed, line
    with pytest.raises(SystemExit):
        main(["inspect", "--json", str(report.out_dir)])
    calibration = json.loads(capsys.readouterr().out)["calibration"]
    assert calibration["expert_tokens"]["1"]["n_experts"] == 8 and len(calibration["warnings"]) == 2
    assert calibration["scheme_fallbacks"]["model.layers.0.mlp.down_proj"]["to"] == "awq g64"
