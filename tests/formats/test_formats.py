"""Pack/unpack of the weight layouts against hand-written vectors from the published layouts."""
import pytest
import torch

from dsquant.formats.awq_gemm import dequantize_awq, pack_awq, to_awq_tensors, unpack_awq
from dsquant.formats.fp8_block import dequantize_fp8_block, quantize_fp8_block
from dsquant.formats.gptq import (dequantize_gptq, pack_gptq_qweight, pack_gptq_qzeros, to_gptq_tensors,
                                  unpack_gptq_qzeros)
from dsquant.formats.int_grid import dequantize_int_groupwise, quantize_int_groupwise


def test_awq_nibble_order_matches_autoawq_layout():
    # AutoAWQ "gemm": nibble i of each int32 holds column AWQ_ORDER[i] = 0, 2, 4, 6, 1, 3, 5, 7
    q = torch.arange(8, dtype=torch.int32).reshape(1, 8) + 1  # columns hold 1..8
    packed = pack_awq(q)
    nibbles = [(int(packed[0, 0]) >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [1, 3, 5, 7, 2, 4, 6, 8]
    assert torch.equal(unpack_awq(packed), q)


def test_gptq_packs_along_k_and_stores_zero_minus_one():
    q = torch.zeros(8, 2, dtype=torch.int32)
    q[:, 0] = torch.arange(8)  # k = 0..7 in column 0
    packed = pack_gptq_qweight(q)
    assert packed.shape == (1, 2)
    assert int(packed[0, 0]) == sum(k << (4 * k) for k in range(8))
    z = torch.full((1, 8), 8, dtype=torch.int32)
    assert int(pack_gptq_qzeros(z)[0, 0]) == sum(7 << (4 * i) for i in range(8))
    assert torch.equal(unpack_gptq_qzeros(pack_gptq_qzeros(z)), z)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_awq_and_gptq_dequantize_to_the_same_grid(group, symmetric):
    torch.manual_seed(group)
    w = torch.randn(48, 256)
    q, scales, zeros = quantize_int_groupwise(w, group, symmetric=symmetric)
    grid = dequantize_int_groupwise(q, scales, zeros, group)
    assert (grid - w).abs().max() <= scales.max() * 0.5 + 1e-6
    awq = dequantize_awq(*to_awq_tensors(q, scales, zeros, torch.float32), group)
    gptq = dequantize_gptq(*to_gptq_tensors(q, scales, zeros, group, torch.float32))
    assert torch.equal(awq, grid) and torch.equal(gptq, grid)


def test_fp8_block_roundtrip_with_partial_edge_blocks():
    torch.manual_seed(0)
    w = torch.randn(300, 200) * 3
    q, scale_inv = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2)
    # each block's absmax maps to 448
    assert torch.allclose(scale_inv[2, 1], w[256:, 128:].abs().max() / 448)
    back = dequantize_fp8_block(q, scale_inv)
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + 1e-6).all()
    with pytest.raises(ValueError, match="weight_scale_inv has shape"):
        dequantize_fp8_block(q, scale_inv[:2])
