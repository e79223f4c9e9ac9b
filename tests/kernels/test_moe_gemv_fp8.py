"""FP8 block expert GEMV (W8A8, decode-sized MoE) against float64 and against the grouped fp8 path.

Properties: for the gated and the routed epilogue and split_k 1, 2, 3 (K = 600: 5 K blocks, the
last partial: uneven splits), with a partial 128-row scale block (N = 200), the GEMV equals the
float64 product of the fp8 activations and weights it consumed, whole output and per 128-channel
block; poisoned outputs are fully written; split-K counters are left zero. Weights are drawn by
tests/realistic_weights.py (block scales over three orders of magnitude, outlier channels, zero
rows and a zero block), so a mis-strided scale matrix shows. (fused_moe does not dispatch it: the grouped FP8 path is faster; see moe_gemv_fp8.py.)
CPU runs fp16 with activations quantized by torch (the interpreter mis-rounds in-kernel
fp8 casts); the GPU runs the in-kernel quantizer in bf16 at V2-Lite shapes.
"""
import pytest
import torch

from dsquant.runtime.kernels.moe.fused_moe_fp8 import quantize_act_fp8, quantize_act_fp8_torch
from dsquant.runtime.kernels.moe.moe_gemv_fp8 import moe_gemv_fp8
from dsquant.runtime.kernels.moe.reference_moe import fp8_act_roundtrip
from tests.kernels.moe_cases import (check_close, pair_case, pair_reference, poisoned, realistic_projection,
                                     v2_lite_decode_case)


@pytest.mark.parametrize("elementwise", [False, True])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_moe_gemv_fp8_matches_dense(gated, split_k, elementwise, device):
    """K = 600: 5 blocks, the last 88 wide (split 2: 3 + 2, split 3: 2 + 2 + 1); gated N = 128
    (w13 256 rows, the up rows in the second scale block), routed N = 200 (a partial scale
    block); 6 pairs."""
    t, top_k, n = 2, 3, 128 if gated else 200
    g, dense, tw, ids, div, a = pair_case("fp8", 5, n, 600, t, top_k, gated, device, seed=split_k)
    aq, a_s = quantize_act_fp8_torch(a)  # [rows, K] e4m3, [rows, 5]
    out = poisoned(t * top_k, n, torch.float16, device)
    moe_gemv_fp8(aq, g, ids, out, a_row_div=div, gated=gated, topk_weights=None if gated else tw,
                 a_scale=a_s, block_n=16, split_k=split_k, elementwise=elementwise)
    check_close(out, pair_reference(fp8_act_roundtrip(a), dense, ids, div, gated, tw), 4e-3)
    assert int(g.splitk_counters.abs().sum()) == 0, "split-K counters must be left zero"


def test_moe_gemv_fp8_rejects_missing_scale(device):
    g, _ = realistic_projection("fp8", 2, 128, 128, torch.float16, device, seed=0)
    ids = torch.zeros(1, 2, dtype=torch.int64, device=device)
    aq, _ = quantize_act_fp8_torch(torch.randn(2, 128, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="a_scale"):
        moe_gemv_fp8(aq, g, ids, torch.empty(2, 128, dtype=torch.float16, device=device), 1, False)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [1, 2, 4, 8])
def test_moe_gemv_fp8_v2_lite_bf16(split_k):
    """V2-Lite shapes (66 experts, H 2048, I 1408), bf16, 8 pairs: the in-kernel quantizer gives
    the result of the pre-quantized path (same quant_group_fp8 arithmetic), both within W8A8
    accuracy of float64, whole output and per 128-channel block; counters reset after every launch."""
    weights, d13, d2, tw, ids, hidden, act_in = v2_lite_decode_case("fp8")
    for w, dense, a, div, gated, n in ((weights.w13, d13, hidden, 8, True, 1408),
                                       (weights.w2, d2, act_in, 1, False, 2048)):
        kw = dict(a_row_div=div, gated=gated, topk_weights=None if gated else tw, block_n=16,
                  num_warps=2, split_k=split_k)
        out = moe_gemv_fp8(a, w, ids, poisoned(8, n, torch.bfloat16, "cuda"), **kw)
        assert int(w.splitk_counters.abs().sum()) == 0
        aq, a_s = quantize_act_fp8(a)
        pre = moe_gemv_fp8(aq, w, ids, poisoned(8, n, torch.bfloat16, "cuda"), a_scale=a_s, **kw)
        check_close(out, pre.double(), 2e-3, what="in-kernel vs pre-quantized")
        elt = moe_gemv_fp8(aq, w, ids, poisoned(8, n, torch.bfloat16, "cuda"), a_scale=a_s, elementwise=True, **kw)
        check_close(elt, pre.double(), 2e-3, what="elementwise vs per-block sums")
        check_close(out, pair_reference(fp8_act_roundtrip(a), dense, ids, div, gated, tw), 1e-2)
