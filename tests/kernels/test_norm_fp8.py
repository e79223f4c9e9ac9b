"""RMSNorm that also quantizes its output for FP8 consumers (kernels/ops/rmsnorm.py `quant`), and the
consumers that take it (fp8_gemm.fp8_block_linear_prequantized, fused_moe's grouped GEMMs): the
codes and scales are per_token_group_quant_fp8's on the stored 16-bit output, bit for bit (GPU),
and each consumer's output equals the one it computes after its own quantization launch."""
import pytest
import torch

from dsquant.formats.fp8_block import quantize_fp8_activations
from dsquant.runtime.kernels.gemm import fp8_quant
from dsquant.runtime.kernels.ops import rmsnorm
from tests.realistic_weights import realistic_activations

HAS_CUDA = torch.cuda.is_available()


def _norm_inputs(m: int, h: int, seed: int, device, dtype=torch.float16):
    """x, residual [M, H] with outlier channels, and a norm weight spread over three orders of
    magnitude (trained norms' are), so the 128-channel groups' scales differ widely."""
    g = torch.Generator().manual_seed(seed)
    x = realistic_activations(m, h, seed=seed, dtype=dtype, device=device)
    residual = (torch.randn(m, h, generator=g) * 2).to(device=device, dtype=dtype)
    weight = torch.exp(torch.randn(h, generator=g) * 1.5).clamp(1e-3, 30).to(device=device, dtype=dtype)
    return x, residual, weight


def _poisoned_buffers(monkeypatch):
    real = fp8_quant.act_buffers

    def poisoned(m, k, device, group=128):
        act = real(m, k, device, group)
        act.q.view(torch.uint8).fill_(0x7E)  # e4m3 448: a visible wrong code
        act.scale.fill_(float("nan"))
        return act

    monkeypatch.setattr(fp8_quant, "act_buffers", poisoned)


def _e4m3_step(ref: torch.Tensor) -> torch.Tensor:
    """One e4m3 rounding step at each reference value (3 mantissa bits; subnormals 2^-9)."""
    r = ref.float().abs()
    return torch.where(r >= 2 ** -6, r * 2 ** -3, torch.full_like(r, 2 ** -9))


@pytest.mark.parametrize("m,h", [(1, 256), (3, 384), (5, 256), (2, 1024)])
@pytest.mark.parametrize("fused_add", [False, True])
def test_norm_quant_layout_and_values(m, h, fused_add, monkeypatch):
    """CPU (interpreter) or GPU: the 16-bit outputs are unchanged by quant, the scales are the torch
    quantizer's exactly, the codes within one e4m3 step of it (the interpreter's fp8 cast rounds
    some values the other way), padding rows zero, the layout fp8_quant.act_layout's."""
    device = "cuda" if HAS_CUDA else "cpu"
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(rmsnorm, "quant_takes", lambda hidden, dev: hidden % 128 == 0)
    _poisoned_buffers(monkeypatch)
    x, residual, weight = _norm_inputs(m, h, seed=m * 7 + h, device=device)
    if fused_add:
        plain, plain_res = rmsnorm.fused_add_rms_norm(x, residual, weight, 1e-6)
        out, res = rmsnorm.fused_add_rms_norm(x, residual, weight, 1e-6, quant=True)
        assert torch.equal(res, plain_res)
    else:
        plain = rmsnorm.rms_norm(x, weight, 1e-6)
        out = rmsnorm.rms_norm(x, weight, 1e-6, quant=True)
    assert torch.equal(out, plain), "quant must not change the 16-bit output"
    assert fp8_quant.attached(plain) is None
    act = fp8_quant.attached(out)
    assert act is not None and act.rows == m
    mult, col = fp8_quant.act_layout(m)
    assert act.column_major == col and act.q.shape[0] == -(-m // mult) * mult
    if col:
        assert act.scale.stride(0) == 1
    ref_q, ref_s = quantize_fp8_activations(out.float().cpu(), 128)
    q, s = (t.cpu() for t in act.unpadded())
    assert torch.equal(s, ref_s), "scales differ from the torch quantizer"
    qf, rf = q.float(), ref_q.float()
    near = (qf - rf).abs() <= _e4m3_step(ref_q) + 1e-12
    # the interpreter's cast drops the carry of a round-up into the exponent: 7.98 -> 4, not 8
    carry_lost = (torch.frexp(rf).mantissa.abs() == 0.5) & (qf == rf / 2)
    assert (near | carry_lost).all(), f"codes off by more than one step: {(qf - rf).abs().max()}"
    if device == "cuda":
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert (act.q[m:].view(torch.uint8) == 0).all() and (act.scale[m:] == 0).all(), "padding rows not zeroed"


def test_norm_quant_off_where_it_cannot():
    """No attachment on CPU tensors without the interpreter, or without whole 128-channel groups."""
    assert not rmsnorm.quant_takes(200, "cuda") and not rmsnorm.quant_takes(256, "cpu")
    x, _, weight = _norm_inputs(2, 256, seed=1, device="cpu", dtype=torch.float32)
    act = fp8_quant.act_buffers(2, 256, "cpu")
    y = fp8_quant.attach(torch.zeros(2, 256), act)
    assert fp8_quant.attached(y) is act
    assert fp8_quant.attached(fp8_quant.carry(y, y.view(1, 2, 256))) is act
    assert fp8_quant.attached(y[:1]) is None  # another tensor: nothing carried
    assert fp8_quant.attached(fp8_quant.attach(torch.zeros(3, 256), act)) is None  # rows differ


def _gpu_fp8():
    if not HAS_CUDA or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs an sm_90 GPU (FP8 tensor cores, in-kernel fp8 casts)")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, 64])
@pytest.mark.parametrize("h", [2048, 7168])
def test_norm_quant_bitwise_gpu(m, h, monkeypatch):
    _gpu_fp8()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _poisoned_buffers(monkeypatch)
    x, residual, weight = _norm_inputs(m, h, seed=m + h, device="cuda", dtype=torch.bfloat16)
    out, _ = rmsnorm.fused_add_rms_norm(x, residual, weight, 1e-6, quant=True)
    act = fp8_quant.attached(out)
    ref_q, ref_s = fp8_quant.per_token_group_quant_fp8(out, 128)
    q, s = act.unpadded()
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, 64])
@pytest.mark.parametrize("k,n", [(2048, 3648), (2048, 21888), (7168, 2112), (2048, 2816)])
def test_prequantized_linear_equals_own_quant_gpu(m, k, n, monkeypatch):
    """fp8_block_linear_prequantized on a norm's codes == fp8_block_linear quantizing by launch."""
    _gpu_fp8()
    from dsquant.runtime.kernels.gemm import gemm_configs
    from dsquant.runtime.kernels.gemm.fp8_gemm import fp8_block_linear, fp8_block_linear_prequantized
    from tests.kernels.fp8_cases import fp8_weights

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    wq, ws, _ = fp8_weights(n, k, "cuda", seed=n + m)
    from dsquant.runtime.kernels.gemm.fp8_gemm import cublas_scale_layout

    ws = cublas_scale_layout(ws.float())
    x, residual, weight = _norm_inputs(m, k, seed=m, device="cuda", dtype=torch.bfloat16)
    normed = rmsnorm.rms_norm(x, weight, 1e-6, quant=True)
    act = fp8_quant.attached(normed)
    y = fp8_block_linear_prequantized(normed, act, wq, ws)
    path = gemm_configs.fp8_config(m, n, k, "cuda").path
    if path == "cublas" and not act.column_major:  # M <= 4 on a large weight: the caller quantizes
        assert y is None
        return
    assert y is not None and y.shape == (m, n)
    ref = fp8_block_linear(normed, wq, ws, fuse_quant=False)
    assert torch.equal(y, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 5, 64])
def test_fused_moe_takes_norm_codes_gpu(t, monkeypatch):
    """FP8 experts fed the norm's codes give the pieces they give after their own quant launch."""
    _gpu_fp8()
    from dsquant.runtime.kernels.moe.fused_moe import MoeWeights, expert_outputs
    from dsquant.runtime.kernels.moe.fused_moe_fp8 import fp8_experts
    from dsquant.formats.fp8_block import quantize_fp8_block
    from tests.realistic_weights import realistic_weight

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    e, h, inter, top_k = 8, 2048, 1408, 3
    def stack(n, k, seed):  # [E, N, K] e4m3 and [E, N/128, K/128] scales, expert by expert
        blocks = [quantize_fp8_block(realistic_weight(n, k, seed=seed + i, draw_device="cuda")) for i in range(e)]
        return fp8_experts(torch.stack([b[0] for b in blocks]).cuda(), torch.stack([b[1] for b in blocks]).cuda())

    weights = MoeWeights(stack(2 * inter, h, 3), stack(h, inter, 40))
    x, _, weight = _norm_inputs(t, h, seed=t, device="cuda", dtype=torch.bfloat16)
    normed = rmsnorm.rms_norm(x, weight, 1e-6, quant=True)
    ids = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(i))[:top_k] for i in range(t)])
    ids = ids.to(device="cuda", dtype=torch.int32)
    with_codes = expert_outputs(normed, weights, ids)
    without = expert_outputs(normed.clone(), weights, ids)
    assert torch.isfinite(with_codes).all() and torch.equal(with_codes, without)
