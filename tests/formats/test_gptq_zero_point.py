"""to_gptq_tensors on a realistic weight: GPTQ v1 stores each zero point as z - 1 in 4 bits,
so z = 0 cannot be stored. quantize_int_groupwise (asymmetric) gives z = 0 to any group whose
minimum lies within half a step below 0, which an outlier input channel (x50, as trained weights
have: tests/realistic_weights.py) makes common; to_gptq_tensors then writes (0 - 1) & 0xF = 15,
read back as 16, so the checkpoint encodes another weight (each value of the group off by
16 * scale) without a word. Writing must either encode the grid it was given or refuse.
(calibrate/gptq.py clamps its zero points to >= 1, so dsquant's own GPTQ export is not hit; a
caller of quantize_int_groupwise + to_gptq_tensors, such as a test, is.)
"""
import torch

from dsquant.formats.awq_gemm import dequantize_awq, to_awq_tensors
from dsquant.formats.gptq import dequantize_gptq, to_gptq_tensors, unpack_gptq_qzeros
from dsquant.formats.int_grid import dequantize_int_groupwise, quantize_int_groupwise
from tests.realistic_weights import realistic_weight

G = 64


def test_gptq_v1_tensors_encode_the_grid_they_are_given_or_refuse():
    w = realistic_weight(64, 256, seed=1, tile=(16, G))
    q, s, z = quantize_int_groupwise(w, G)  # codes [N, K], scales / zeros [N, K/G]
    assert (z == 0).any()  # the case in question: some group's zero point is 0
    try:
        qweight, qzeros, scales, g_idx = to_gptq_tensors(q, s, z, G)
    except ValueError:
        return  # refusing a zero point GPTQ v1 cannot store is an answer
    grid = dequantize_int_groupwise(q, scales.t().float(), z, G)  # the grid, fp16 scales
    got = dequantize_gptq(qweight, qzeros, scales, g_idx)
    wrong = (got != grid).sum().item()
    assert wrong == 0, (f"{wrong} of {grid.numel()} weights changed by the v1 zero-point store "
                        f"(zero points 0 read back as {unpack_gptq_qzeros(qzeros).max().item()})")


def test_awq_tensors_encode_the_same_grid():
    """AWQ stores z itself: the same grid round-trips exactly (the contrast to the test above)."""
    w = realistic_weight(64, 256, seed=1, tile=(16, G))
    q, s, z = quantize_int_groupwise(w, G)
    qweight, qzeros, scales = to_awq_tensors(q, s, z)
    grid = dequantize_int_groupwise(q, scales.t().float(), z, G)
    assert torch.equal(dequantize_awq(qweight, qzeros, scales, G), grid)
