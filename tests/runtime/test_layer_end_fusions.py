"""A MoE layer's expert sum run inside the next layer's input norm launch (layers/fused.DEFER_MOE_SUM,
kernels/moe/moe_sum.moe_sum_rms_norm) changes when the sum runs, never what it computes: CUDA-graph
decode gives the same tokens and log-probabilities, bit for bit, with the sum deferred and with each
MoE layer summing in its own launch, for BF16, AWQ and FP8 experts."""
import pytest
import torch

from dsquant.runtime.layers import fused

from conftest import build_hf, random_prompts
from test_pdl_engine import _decode
from test_quantized_checkpoints import write_pair


@pytest.fixture(scope="module")
def deep_moe(tmp_path_factory):
    """wide_moe with three layers: MoE layers 1 and 2, so layer 1's sum is deferred into layer 2's norm."""
    path = tmp_path_factory.mktemp("deep_moe")
    build_hf("deepseek_v2", hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
             num_hidden_layers=3).save_pretrained(path)
    return path


def _cpu_decode(path, prompts):
    from dsquant.runtime.engine.llm_engine import EngineConfig

    return _decode(path, prompts, EngineConfig(device="cpu", dtype=torch.float32, block_size=16, num_blocks=32,
                                               max_model_len=64, kernels=True, enforce_eager=True), max_tokens=3)


def test_deferred_sum_on_cpu_interpreter(deep_moe, monkeypatch):
    """CPU, Triton interpreter: every MoE layer but the last hands its sum to the next layer's norm
    (counted), and the tokens and log-probabilities equal those of per-layer sums."""
    from dsquant.runtime.kernels.moe import moe_sum as ms

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    real = ms.moe_sum_rms_norm
    monkeypatch.setattr(ms, "moe_sum_rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = random_prompts(2, [5, 7], seed=4)
    monkeypatch.setattr(fused, "DEFER_MOE_SUM", False)
    off = _cpu_decode(deep_moe, prompts)
    assert not calls
    monkeypatch.setattr(fused, "DEFER_MOE_SUM", True)
    assert _cpu_decode(deep_moe, prompts) == off
    assert calls, "no layer deferred its sum"


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "awq", "fp8"])
def test_deferred_moe_sum_decode_is_bitwise_unchanged(scheme, deep_moe, tmp_path, monkeypatch):
    path = deep_moe if scheme == "bf16" else write_pair(deep_moe, tmp_path, scheme)[0]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for batch in (1, 3, 6):
        prompts = random_prompts(batch, [9, 14, 3][:batch], seed=batch)
        monkeypatch.setattr(fused, "DEFER_MOE_SUM", False)
        off = _decode(path, prompts)
        monkeypatch.setattr(fused, "DEFER_MOE_SUM", True)
        assert _decode(path, prompts) == off, (scheme, batch)
