"""dsquant/formats/: every reader and writer goes through one dataclass per format.

A config dsquant writes parses back to the dataclass that wrote it; a config another tool wrote
(DeepSeek-V3's FP8, AutoAWQ's, llm-compressor's) parses and writes back as it was; the parsed
config names each module's scheme; an unknown method is refused naming the file.
"""
import pytest

from dsquant.errors import ConfigError
from dsquant.formats import (AwqConfig, CompressedTensorsConfig, CTFp8Scheme, CTInt4Scheme, Fp8BlockConfig,
                             GptqConfig, parse_quantization_config)
from dsquant.formats.compressed_tensors import CTGroup

WRITTEN = [AwqConfig(64, ("mlp.down_proj",)), AwqConfig(128, ()),
           GptqConfig(32, sym=False, desc_act=True, modules_to_not_convert=("model.layers.0.mlp.down_proj",),
                      damp_percent=0.05, static_groups=True),
           Fp8BlockConfig(()), Fp8BlockConfig(),
           CompressedTensorsConfig.from_groups([CTGroup.fp8_block([r"re:^model\.layers\.\d+\.self_attn\..*$"]),
                                                CTGroup.pack_quantized(["Linear"], 64)], ["lm_head"])]


@pytest.mark.parametrize("config", WRITTEN, ids=lambda c: c.method)
def test_a_written_config_parses_back_to_the_dataclass_that_wrote_it(config):
    assert parse_quantization_config(config.to_dict()) == config
    assert parse_quantization_config(config.to_dict()).to_dict() == config.to_dict()


def test_configs_other_tools_write_come_back_as_they_were():
    deepseek_v3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                   "weight_block_size": [128, 128]}
    autoawq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
               "modules_to_not_convert": None}
    for q in (deepseek_v3, autoawq):
        assert parse_quantization_config(q).to_dict() == q
    assert "modules_to_not_convert" not in parse_quantization_config(deepseek_v3).to_dict()


def test_the_parsed_config_names_each_modules_scheme():
    awq = parse_quantization_config({"quant_method": "awq", "group_size": 64, "modules_to_not_convert": ["kv_b_proj"]})
    assert awq.scheme_for("model.layers.0.mlp.down_proj") == awq and awq.group_size == 64
    assert awq.scheme_for("model.layers.3.self_attn.kv_b_proj") is None and awq.scheme_for("lm_head") is None
    fp8 = parse_quantization_config({"quant_method": "fp8", "ignored_layers": ["mlp.gate_proj"]})
    assert fp8.scheme_for("model.layers.0.mlp.up_proj") == fp8
    assert fp8.scheme_for("model.layers.0.mlp.gate_proj") is None
    ct = WRITTEN[-1]
    assert ct.scheme_for("model.layers.1.self_attn.q_proj") == CTFp8Scheme("block", True)
    assert ct.scheme_for("model.layers.1.mlp.experts.3.up_proj") == CTInt4Scheme(64, False)
    assert ct.scheme_for("lm_head") is None


def test_gptq_v2_and_act_order_read_from_the_config():
    v2 = parse_quantization_config({"quant_method": "gptq", "group_size": 128, "checkpoint_format": "gptq_v2",
                                    "desc_act": True, "sym": False}, "quantize_config.json")
    assert v2.v2 and v2.desc_act and v2.zero_point and v2.source == "quantize_config.json"
    assert v2.describe() == ("gptq 4-bit, group 128, asymmetric (zero point), GPTQ v2, act-order (desc_act) "
                             "(from quantize_config.json)")


def test_a_dense_checkpoint_has_no_format_and_an_unknown_method_is_refused():
    assert parse_quantization_config(None) is None and parse_quantization_config({}) is None
    with pytest.raises(ConfigError, match=r"^quant_config\.json: quantization_config\.quant_method 'bitsandbytes' "
                                          r"is not supported \(expected awq, gptq, fp8 or compressed-tensors\)$"):
        parse_quantization_config({"quant_method": "bitsandbytes"}, "quant_config.json")
    with pytest.raises(ConfigError, match=r"^config\.json: fp8 weight_block_size \[64, 64\] is not supported"):
        parse_quantization_config({"quant_method": "fp8", "weight_block_size": [64, 64]})


@pytest.mark.parametrize("actorder", [None, "weight", "static", "group", "dynamic"])
def test_compressed_tensors_actorder(actorder):
    """llm-compressor's GPTQ actorder "weight" (alias "static") changes no tensor; "group" (alias
    "dynamic") stores weight_g_idx, each input channel's group (CTInt4Scheme.g_idx), which needs the
    group strategy."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
               "actorder": actorder}
    group = {"targets": ["Linear"], "format": "pack-quantized", "weights": weights}
    config = {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}, "ignore": ["lm_head"]}
    g_idx = actorder in ("group", "dynamic")
    assert parse_quantization_config(config).scheme_for("model.layers.0.mlp.up_proj") == CTInt4Scheme(128, True, g_idx)
    weights.update(strategy="channel", group_size=None)
    if g_idx:
        with pytest.raises(ConfigError, match=f"actorder '{actorder}' needs the group strategy, got 'channel'"):
            parse_quantization_config(config).scheme_for("model.layers.0.mlp.up_proj")
    weights.update(strategy="group", group_size=128, actorder="sometimes")
    with pytest.raises(ConfigError, match="actorder 'sometimes' is not supported"):
        parse_quantization_config(config).scheme_for("model.layers.0.mlp.up_proj")
