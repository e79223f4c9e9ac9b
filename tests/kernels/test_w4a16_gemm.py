"""W4A16 dequant-GEMM against a float64 reference built from the checkpoint codecs (dsquant.formats).

Properties: the AWQ/GPTQ repacks dequantize to exactly the checkpoint's weight; the kernel, on
every path (split-K decode, tiled prefill, dequantize + cuBLAS), matches x @ W^T on fresh random
inputs for M in {1, 3, 17, 64, 300}, every group size, N and K that are not multiples of the
tiles, and GPTQ act-order; the poisoned (NaN) output is fully overwritten; split-K counters are
left at zero. CPU: fp16 under TRITON_INTERPRET=1; GPU: the same at full size in bf16.
"""
import pytest
import torch

from dsquant import formats as F
from dsquant.runtime.kernels.gemm_configs import GemmConfig
from dsquant.runtime.kernels.w4a16_gemm import w4a16_dequantize, w4a16_linear
from dsquant.runtime.kernels.w4a16_repack import (dequantize_w4a16, repack_awq, repack_gptq,
                                                  w4a16_linear_reference)

M_VALUES = [1, 3, 17, 64, 300]


def _awq_weights(n, k, group, device, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    q, s, z = F.quantize_int_groupwise(w, group)
    qweight, qzeros, scales = F.to_awq_tensors(q, s, z, dtype=torch.float16)
    dense = F.dequantize_awq(qweight, qzeros, scales, group, torch.float64)  # [N, K]
    packed = repack_awq(qweight.to(device), qzeros.to(device), scales.to(device), group)
    return packed, dense


def _act_order_gptq(n, k, group, device, seed):
    """GPTQ v1 tensors with a random act-order g_idx, and their dense weight."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    order = torch.randperm(k, generator=gen)  # channel order[j] is quantized j-th
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    q, s, z = F.quantize_int_groupwise(w[:, order], group)  # groups along the act order
    z = z.clamp(1, 15)
    q_orig = torch.empty_like(q)
    q_orig[:, order] = q
    qweight = F.pack_gptq_qweight(q_orig.t())
    qzeros = F.pack_gptq_qzeros(z.t())
    scales = s.t().contiguous().to(torch.float16)
    dense = F.dequantize_gptq(qweight, qzeros, scales, g_idx, torch.float64)
    packed = repack_gptq(qweight.to(device), qzeros.to(device), scales.to(device), g_idx.to(device))
    return packed, dense


def _check(y, x, dense, dtype):
    ref = x.to(torch.float64).cpu() @ dense.t()
    assert torch.isfinite(y).all(), "output has NaN/Inf: some element was not written"
    err = ((y.cpu().to(torch.float64) - ref).norm() / ref.norm()).item()
    assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), err


def _poisoned(m, n, dtype, device):
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_repack_awq_dequantizes_to_checkpoint_weight(group):
    packed, dense = _awq_weights(72, 4 * group, group, "cpu", seed=group)
    assert torch.equal(dequantize_w4a16(packed, torch.float64), dense)


def test_repack_gptq_act_order_matches_g_idx_dequant():
    packed, dense = _act_order_gptq(40, 256, 64, "cpu", seed=5)
    assert packed.perm is not None and sorted(packed.perm.tolist()) == list(range(256))
    x = torch.randn(5, 256, dtype=torch.float64)
    y = w4a16_linear_reference(x, packed, torch.float64)
    assert torch.allclose(y, x @ dense.t(), rtol=1e-10, atol=1e-10)


def test_repack_rejects_mismatched_scales():
    packed, _ = _awq_weights(64, 256, 64, "cpu", seed=1)
    qweight = F.pack_awq(torch.zeros(256, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="scales has shape"):
        repack_awq(qweight, torch.zeros(4, 8, dtype=torch.int32), torch.ones(3, 64), 64)


def _decode_cfg(m, split):
    return GemmConfig(max(16, 1 << (m - 1).bit_length()), 64, split, 4, 2)


CPU_CASES = [  # (M, group, config or None for the heuristic)
    *[(m, g, None) for m in M_VALUES for g in (32, 64, 128)],
    (1, 32, _decode_cfg(1, 3)), (3, 64, _decode_cfg(3, 4)), (17, 128, _decode_cfg(17, 2)),
    (64, 32, _decode_cfg(64, 4)), (300, 64, GemmConfig(64, 64, 1, 4, 2)),
    (17, 64, GemmConfig(128, 128, 1, 8, 2, path="dequant")),
    # GEMV (M <= 4): uneven splits, narrow and wide channel blocks, padded token block
    (1, 64, GemmConfig(1, 32, 3, 4, 1, path="gemv")), (2, 32, GemmConfig(2, 128, 1, 4, 1, path="gemv")),
    (3, 128, GemmConfig(4, 64, 2, 2, 1, path="gemv")), (4, 64, GemmConfig(4, 16, 4, 1, 1, path="gemv")),
]


@pytest.mark.parametrize("m,group,cfg", CPU_CASES)
def test_w4a16_awq_matches_reference(device, m, group, cfg):
    # N = 200 and K = 5 groups are multiples of no tile and split unevenly over split-K
    n, k = 200, 5 * group
    packed, dense = _awq_weights(n, k, group, device, seed=m * 1000 + group)
    x = torch.randn(m, k, dtype=torch.float16, device=device)
    y = w4a16_linear(x, packed, cfg, out=_poisoned(m, n, torch.float16, device))
    _check(y, x, dense, torch.float16)
    assert int(packed.splitk_counters.abs().sum()) == 0


@pytest.mark.parametrize("m,cfg", [(3, _decode_cfg(3, 2)), (300, None), (2, GemmConfig(2, 64, 3, 4, 1, path="gemv")),
                                   (17, GemmConfig(32, 64, 1, 4, 2, path="dequant"))])
def test_w4a16_gptq_act_order_matches_reference(device, m, cfg):
    packed, dense = _act_order_gptq(136, 320, 64, device, seed=m)
    x = torch.randn(m, 320, dtype=torch.float16, device=device)
    y = w4a16_linear(x, packed, cfg, out=_poisoned(m, 136, torch.float16, device))
    _check(y, x, dense, torch.float16)


def test_w4a16_dequantize_kernel_matches_codec(device):
    packed, dense = _awq_weights(136, 192, 64, device, seed=11)
    w = w4a16_dequantize(packed, torch.float16)
    assert torch.allclose(w.cpu().double(), dense, rtol=1e-3, atol=1e-4)


def test_w4a16_rejects_wrong_in_features(device):
    packed, _ = _awq_weights(64, 128, 64, device, seed=2)
    with pytest.raises(ValueError, match="in_features 128"):
        w4a16_linear(torch.randn(2, 96, dtype=torch.float16, device=device), packed)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", M_VALUES + [1024])
def test_w4a16_gpu_full_size_bf16(m, group):
    n, k = 2824, 7168 - 2 * group  # N: 8 x odd; K: no multiple of 256
    packed, dense = _awq_weights(n, k, group, "cuda", seed=m + group)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    y = w4a16_linear(x, packed, out=_poisoned(m, n, torch.bfloat16, "cuda"))
    _check(y, x, dense, torch.bfloat16)
    for split in (1, 3, 8):  # explicit decode configs, uneven splits
        if m <= 64:
            y = w4a16_linear(x, packed, GemmConfig(max(16, 1 << (m - 1).bit_length()), 128, split, 4, 4),
                             out=_poisoned(m, n, torch.bfloat16, "cuda"))
            _check(y, x, dense, torch.bfloat16)
        if m <= 4:  # the GEMV with explicit configs
            cfg = GemmConfig(1 << (m - 1).bit_length(), {1: 32, 3: 64, 8: 128}[split], split, 4, 1, path="gemv")
            y = w4a16_linear(x, packed, cfg, out=_poisoned(m, n, torch.bfloat16, "cuda"))
            _check(y, x, dense, torch.bfloat16)
    assert int(packed.splitk_counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17, 300])
def test_w4a16_gpu_gptq_act_order_bf16(m):
    packed, dense = _act_order_gptq(1032, 2048, 128, "cuda", seed=m)
    x = torch.randn(m, 2048, dtype=torch.bfloat16, device="cuda")
    y = w4a16_linear(x, packed, out=_poisoned(m, 1032, torch.bfloat16, "cuda"))
    _check(y, x, dense, torch.bfloat16)
