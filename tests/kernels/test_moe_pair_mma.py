"""INT4 experts at decode on the tensor cores with split-K (moe_pair_mma.py) against the float64 pair
reference, as the per-pair GEMVs are tested (test_moe_gemv.py, test_moe_gemv_fp8.py): realistic weights (group scales over three
orders of magnitude, outlier channels, zero rows and a zero tile), outputs poisoned with NaN, every split
factor including uneven ones, counters left zero so a repeated launch gives the same bits, a pair on
another rank (negative id) reading nothing. On CPU (Triton interpreter) fp16, the unpaired INT4
dequantization and FP8 dots upcast to fp32 on activations quantized by torch; on the GPU bf16, the paired
dequantization and e4m3 tensor-core dots, at V2-Lite and V3 shapes."""
import pytest
import torch

from dsquant.runtime.kernels.moe import fused_moe as fm
from dsquant.runtime.kernels.moe.fused_moe_fp8 import quantize_act_fp8, quantize_act_fp8_torch
from dsquant.runtime.kernels.moe.moe_pair_mma import moe_pair_mma_fp8, moe_pair_mma_int4
from dsquant.runtime.kernels.moe.reference_moe import fp8_act_roundtrip, moe_experts_reference
from tests.kernels.moe_cases import (V3_REDUCED, check_close, hidden_states, make_experts, pair_case,
                                     pair_reference, poisoned, random_topk, realistic_projection,
                                     v2_lite_decode_case, v3_experts)


@pytest.mark.parametrize("fmt", ["int4-g32", "int4-g64", "int4-g128", "int4ao-g128"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_pair_mma_matches_dense(fmt, gated, split_k, device):
    """K = 640 is 5 chunks (split 2: 3 + 2, split 3: 2 + 2 + 1); N = 48 leaves a partial 32-row block;
    2 tokens x top-3 = 6 pairs; launched twice into poisoned outputs: same bits, counters zero.
    int4ao: act-order experts, the activations gathered through each expert's channel order."""
    t, top_k, n = 2, 3, 48
    g, dense, tw, ids, div, a = pair_case(fmt, 5, n, 640, t, top_k, gated, device, seed=split_k)
    ref = pair_reference(a, dense, ids, div, gated, tw)
    outs = []
    for _ in range(2):
        out = poisoned(t * top_k, n, torch.float16, device)
        moe_pair_mma_int4(a, g, ids, out, a_row_div=div, gated=gated, topk_weights=None if gated else tw,
                          block_n=32, num_warps=4, split_k=split_k)
        assert torch.isfinite(out).all() and int(g.splitk_counters.abs().sum()) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    check_close(outs[0], ref, 4e-3)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_pair_fp8_matches_dense(gated, split_k, device):
    """K = 600: 5 blocks, the last 88 wide (split 2: 3 + 2, split 3: 2 + 2 + 1); gated N = 128 (the up
    rows in the second scale block), routed N = 200 (a partial scale block); 6 pairs; twice into
    poisoned outputs: same bits, counters zero."""
    t, top_k, n = 2, 3, 128 if gated else 200
    g, dense, tw, ids, div, a = pair_case("fp8", 5, n, 600, t, top_k, gated, device, seed=split_k)
    aq, a_s = quantize_act_fp8_torch(a)  # [rows, K] e4m3, [rows, 5]
    ref = pair_reference(fp8_act_roundtrip(a), dense, ids, div, gated, tw)
    outs = []
    for _ in range(2):
        out = poisoned(t * top_k, n, torch.float16, device)
        moe_pair_mma_fp8(aq, a_s, g, ids, out, a_row_div=div, gated=gated, topk_weights=None if gated else tw,
                         block_n=32, split_k=split_k, block_m=64 if split_k == 2 else 16,
                         fp8_upcast=device == "cpu")
        assert torch.isfinite(out).all() and int(g.splitk_counters.abs().sum()) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    check_close(outs[0], ref, 4e-3)


def test_pair_fp8_rejects_unquantized_activations(device):
    g, _ = realistic_projection("fp8", 2, 128, 128, torch.float16, device, seed=0)
    ids = torch.zeros(1, 2, dtype=torch.int64, device=device)
    a = torch.randn(2, 128, dtype=torch.float16, device=device)
    _, a_s = quantize_act_fp8_torch(a)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        moe_pair_mma_fp8(a, a_s, g, ids, torch.empty(2, 128, dtype=torch.float16, device=device), 1, False)


def test_pair_mma_negative_id_reads_nothing(device):
    """A pair whose expert is on another rank (id -1) gets zeros; the others are unchanged."""
    t, top_k, n = 1, 4, 32
    g, dense, tw, ids, div, a = pair_case("int4-g128", 4, n, 256, t, top_k, False, device, seed=7)
    ids = ids.clone()
    ids[0, 1] = -1
    out = poisoned(t * top_k, n, torch.float16, device)
    moe_pair_mma_int4(a, g, ids, out, a_row_div=div, gated=False, topk_weights=tw, block_n=16, split_k=2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    keep = [0, 2, 3]
    ref = pair_reference(a[keep], dense, ids[:, keep], div, False, tw[:, keep])
    check_close(out[keep], ref, 4e-3)


def test_pair_mma_rejects_bad_arguments(device):
    g, _ = realistic_projection("int4-g128", 2, 128, 128, torch.float16, device, seed=0)
    ids = torch.zeros(1, 2, dtype=torch.int64, device=device)
    a = torch.randn(2, 128, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="block_n"):
        moe_pair_mma_int4(a, g, ids, torch.empty(2, 128, dtype=torch.float16, device=device), 1, False, block_n=8)
    with pytest.raises(ValueError, match="out"):
        moe_pair_mma_int4(a, g, ids, torch.empty(2, 64, dtype=torch.float16, device=device), 1, False)


@pytest.mark.parametrize("t,k", [(1, 6), (2, 3)])
def test_fused_moe_takes_pair_mma_when_switched_on(t, k, device, monkeypatch):
    """fused_moe's decode path with MOE_PAIR_MMA on (the default) equals the float64 expert loop, and
    really ran the pair MMA (not the GEMV)."""
    monkeypatch.setattr(fm, "MOE_PAIR_MMA", True)
    calls = []
    monkeypatch.setattr(fm, "moe_pair_mma_int4", lambda *a, **kw: calls.append(kw) or moe_pair_mma_int4(*a, **kw))
    weights, d13, d2 = make_experts("int4-g64", 8, 256, 128, torch.float16, device, seed=t * 10 + k)
    hidden = hidden_states(t, 256, torch.float16, device, seed=k)
    tw, ids = random_topk(t, 8, k, device)
    out = fm.fused_moe(hidden, weights, tw, ids)
    check_close(out, moe_experts_reference(hidden, d13, d2, tw, ids), 4e-3)
    assert len(calls) == 2


@pytest.mark.parametrize("t,k", [(1, 6), (2, 3)])
def test_fused_moe_takes_pair_fp8_when_switched_on(t, k, device, monkeypatch):
    """fused_moe's FP8 decode with MOE_PAIR_MMA_FP8 on equals the grouped path (the same activation
    quantization and products) and ran the pair kernel."""
    weights, d13, d2 = make_experts("fp8", 8, 256, 128, torch.float16, device, seed=t * 10 + k)
    hidden = hidden_states(t, 256, torch.float16, device, seed=k)
    tw, ids = random_topk(t, 8, k, device)
    grouped = fm.fused_moe(hidden, weights, tw, ids)
    monkeypatch.setattr(fm, "MOE_PAIR_MMA_FP8", True)
    calls = []
    monkeypatch.setattr(fm, "moe_pair_mma_fp8", lambda *a, **kw: calls.append(kw) or moe_pair_mma_fp8(*a, **kw))
    out = fm.fused_moe(hidden, weights, tw, ids)
    assert len(calls) == 2
    check_close(out, grouped.double(), 4e-3, what="pair fp8 vs grouped")


def _projections(weights, d13, d2, tw, ids, hidden, act_in, configs):
    """Both projections, each config (block_n, warps, split_k), twice into poisoned outputs, against
    the float64 pair reference."""
    pairs = ids.numel()
    for w, dense, a, div, gated in ((weights.w13, d13, hidden, ids.shape[1], True),
                                    (weights.w2, d2, act_in, 1, False)):
        n = w.n // 2 if gated else w.n
        ref = pair_reference(a, dense, ids, div, gated, tw)  # [P, n]
        for block_n, warps, split_k in configs:
            for _ in range(2):
                out = moe_pair_mma_int4(a, w, ids, poisoned(pairs, n, torch.bfloat16, "cuda"), a_row_div=div,
                                        gated=gated, topk_weights=None if gated else tw, block_n=block_n,
                                        num_warps=warps, split_k=split_k)
                assert int(w.splitk_counters.abs().sum()) == 0
                check_close(out, ref, 1e-2, what=f"{'gate/up' if gated else 'down'} {block_n}, {warps}, {split_k}")


@pytest.mark.gpu
def test_pair_mma_v2_lite_bf16():
    """V2-Lite decode (8 pairs: top-6 + 2 shared; gate/up N 2 x 1408, K 2048; down N 2048, K 1408 =
    11 chunks) in bf16 with the paired dequantization: splits even, uneven and the default."""
    _projections(*v2_lite_decode_case("int4-g128"), configs=[(32, 4, 4), (64, 4, None), (128, 4, 8), (16, 1, 3)])


@pytest.mark.gpu
def test_pair_mma_v3_bf16():
    """16 V3-shaped experts in bf16 (gate/up: N 2 x 2048, K 7168 = 56 chunks; down: N 7168, K 2048),
    one token's 8 pairs."""
    weights, d13, d2 = v3_experts("int4-g128")
    tw, ids = random_topk(1, V3_REDUCED["e"], 8, "cuda")
    hidden = hidden_states(1, V3_REDUCED["hidden"], torch.bfloat16, "cuda", seed=5)
    act_in = hidden_states(8, V3_REDUCED["inter"], torch.bfloat16, "cuda", seed=6)
    _projections(weights, d13, d2, tw, ids, hidden, act_in, configs=[(64, 4, 7), (64, 4, None)])


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [1, 4, None])
def test_pair_fp8_v2_lite_bf16(split_k):
    """V2-Lite FP8 experts in bf16, 8 pairs, e4m3 tensor-core dots: within W8A8 accuracy of float64 and
    equal to the grouped kernel's pieces, whole output and per 128-channel block."""
    weights, d13, d2, tw, ids, hidden, act_in = v2_lite_decode_case("fp8")
    for w, dense, a, div, gated, n in ((weights.w13, d13, hidden, 8, True, 1408),
                                       (weights.w2, d2, act_in, 1, False, 2048)):
        aq, a_s = quantize_act_fp8(a)
        for block_n, warps, block_m in ((32, 2, 16), (64, 4, 16), (128, 4, 16), (64, 4, 64), (32, 4, 64)):
            out = moe_pair_mma_fp8(aq, a_s, w, ids, poisoned(8, n, torch.bfloat16, "cuda"), a_row_div=div,
                                   gated=gated, topk_weights=None if gated else tw, block_n=block_n,
                                   num_warps=warps, split_k=split_k, block_m=block_m)
            assert int(w.splitk_counters.abs().sum()) == 0
            check_close(out, pair_reference(fp8_act_roundtrip(a), dense, ids, div, gated, tw), 1e-2,
                        what=f"{block_n}, {warps}, split {split_k}")
