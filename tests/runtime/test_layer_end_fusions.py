"""Launch fusions at layer ends that must not change a bit.
- RMSNorms that quantize their outputs for FP8 consumers (layers/fused.mark_fp8_norms) change which
  launch quantizes the activations, never the codes: FP8 CUDA-graph decode gives the same tokens and
  log-probabilities with the norms quantizing and with each consumer quantizing by its own launch, at
  batches on the GEMVs (row-major scales) and on cuBLAS (padded column-major ones).
- A MoE layer's expert sum deferred into the next layer's input norm (fused.DEFER_MOE_SUM) changes
  nothing either, for BF16, AWQ and FP8 experts."""
import pytest
import torch

from dsquant.runtime.kernels.gemm import fp8_gemm
from dsquant.runtime.layers import fused

from conftest import random_prompts
from test_pdl_engine import _decode
from test_quantized_checkpoints import write_pair


def test_fp8_norms_marked_at_load(wide_moe, tmp_path, monkeypatch):
    """CPU: the model builder marks the input and post-attention norms of an FP8 model, none of BF16,
    and none when the switch is off."""
    from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine

    monkeypatch.setattr(fused, "FP8_NORM_QUANT", True)

    def marked(path):
        eng = LLMEngine(path, EngineConfig(device="cpu", dtype=torch.float32, block_size=16, num_blocks=16,
                                           max_model_len=64, kernels=True, enforce_eager=True))
        return [(i, n) for i, layer in enumerate(eng.model.model.layers)
                for n in ("input_layernorm", "post_attention_layernorm")
                if getattr(getattr(layer, n), "emit_fp8", False)]

    fp8 = marked(write_pair(wide_moe, tmp_path, "fp8")[0])
    assert fp8 and {n for _, n in fp8} == {"input_layernorm", "post_attention_layernorm"}
    assert marked(wide_moe) == []
    monkeypatch.setattr(fused, "FP8_NORM_QUANT", False)
    (tmp_path / "off").mkdir()
    assert marked(write_pair(wide_moe, tmp_path / "off", "fp8")[0]) == []


@pytest.mark.gpu
def test_fp8_norm_quant_decode_is_bitwise_unchanged(wide_moe, tmp_path, monkeypatch):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("W8A8 FP8 needs sm_90")
    path = write_pair(wide_moe, tmp_path, "fp8")[0]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    # the one-token K-block GEMV would otherwise quantize inside itself (another summation order)
    monkeypatch.setattr(fp8_gemm, "kblock_fuses_quant", lambda m, n, k: False)
    for batch in (1, 3, 6):
        prompts = random_prompts(batch, [9, 14, 3][:batch], seed=batch)
        monkeypatch.setattr(fused, "FP8_NORM_QUANT", False)
        off = _decode(path, prompts)
        monkeypatch.setattr(fused, "FP8_NORM_QUANT", True)
        assert _decode(path, prompts) == off, batch


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "awq", "fp8"])
def test_deferred_moe_sum_decode_is_bitwise_unchanged(scheme, wide_moe, tmp_path, monkeypatch):
    """A MoE layer's expert sum run inside the next layer's input norm (moe_sum_rms_norm) gives the
    tokens and log-probabilities of the two launches, bit for bit."""
    path = wide_moe if scheme == "bf16" else write_pair(wide_moe, tmp_path, scheme)[0]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for batch in (1, 3, 6):
        prompts = random_prompts(batch, [9, 14, 3][:batch], seed=batch)
        monkeypatch.setattr(fused, "DEFER_MOE_SUM", False)
        off = _decode(path, prompts)
        monkeypatch.setattr(fused, "DEFER_MOE_SUM", True)
        assert _decode(path, prompts) == off, (scheme, batch)
