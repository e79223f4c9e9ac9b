"""Export codecs round-trip exactly: what dsquant writes, its loader reads back bit for bit.

For each format a random weight is quantized, written with `linear_tensors` into a safetensors
checkpoint, and read back through the loader's dequantizing WeightSource; the result must equal
the quantizer's own dequantized weight exactly (the sequential calibration forward used it).
"""
import pytest
import torch
from safetensors.torch import save_file

from dsquant.calibrate.quantizers import fp8_block, int_grid
from dsquant.calibrate.recipe import SchemeSpec
from dsquant.config import config_from_dict
from dsquant.export.codecs import linear_tensors, scale_dtype_for
from dsquant.models.checkpoint import CheckpointReader
from dsquant.models.loader import WeightSource

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 1}
QUANT_METHOD = {"awq": "awq", "gptq": "gptq", "fp8": "fp8", "compressed-tensors": "compressed-tensors"}


@pytest.mark.parametrize("fmt, scheme, group", [
    ("awq", "awq", 32), ("awq", "rtn", 128), ("gptq", "gptq", 64), ("fp8", "fp8_block", 128),
    ("compressed-tensors", "awq", 128), ("compressed-tensors", "fp8_block", 128)])
def test_written_tensors_dequantize_to_the_quantizer_weights(fmt, scheme, group, tmp_path):
    torch.manual_seed(group)
    w = torch.randn(136, 256) * 0.3  # N = 136: a partial FP8 block, still a multiple of 8
    spec = SchemeSpec(scheme, 4, group)
    qw = fp8_block(w, spec) if scheme == "fp8_block" else int_grid(w, spec, scale_dtype_for(fmt))
    name = "model.layers.0.mlp.down_proj"
    save_file(linear_tensors(name, qw, fmt), tmp_path / "model.safetensors")
    cfg = config_from_dict({**CONFIG, "quantization_config": {"quant_method": QUANT_METHOD[fmt],
                                                              "group_size": group}})
    source = WeightSource(CheckpointReader(tmp_path), cfg)
    got = source.dense_weight(f"{name}.weight", torch.float32)
    assert got is not None and torch.equal(got, qw.dequantized)
    assert not torch.equal(got, w)
