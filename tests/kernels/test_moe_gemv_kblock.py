"""The K-block INT4 expert GEMV (moe_gemv_kblock.py) against the float64 pair loop and moe_gemv_int4.

Weights come from tests/realistic_weights.py through moe_cases (group scales over three orders of
magnitude along N and K, outlier input channels, zero rows and a zero tile); outputs are poisoned with
NaN; K = 640 is 5 chunks, so K_CHUNKS 4 leaves a partial second block and K_CHUNKS 8 a masked one; N
= 208 (13 x 16) leaves a partial 32-row block; split_k > 1 reduces through the counters, which must be
left zero.
"""
import pytest
import torch

from dsquant.runtime.kernels.moe.moe_gemv import moe_gemv_int4
from dsquant.runtime.kernels.moe.moe_gemv_kblock import moe_gemv_int4_kblock
from tests.kernels.moe_cases import (V3_REDUCED, check_close, pair_case, pair_reference, poisoned, random_topk,
                                     hidden_states, v2_lite_decode_case, v3_experts)


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("group,block_n,k_chunks,split_k", [(32, 16, 4, 1), (128, 16, 8, 1), (64, 32, 2, 2),
                                                           (128, 8, 1, 3)])
def test_moe_gemv_kblock_matches_dense(group, gated, block_n, k_chunks, split_k, device):
    t, top_k, n = 2, 3, 208
    g, dense, tw, ids, div, a = pair_case(f"int4-g{group}", 5, n, 640, t, top_k, gated, device, seed=group)
    out = poisoned(t * top_k, n, torch.float16, device)
    moe_gemv_int4_kblock(a, g, ids, out, a_row_div=div, gated=gated, topk_weights=None if gated else tw,
                         block_n=block_n, k_chunks=k_chunks, num_warps=2, split_k=split_k)
    check_close(out, pair_reference(a, dense, ids, div, gated, tw), 4e-3)
    assert g.splitk_counters is None or int(g.splitk_counters.abs().sum()) == 0, "counters must be left zero"


def test_moe_gemv_kblock_repeated_split_launch_same_bits(device):
    """split_k 2 launched twice: the counters are reset, every element is written, the bits repeat."""
    g, dense, tw, ids, div, a = pair_case("int4-g128", 4, 32, 640, 1, 4, False, device, seed=4)
    outs = []
    for _ in range(2):
        out = poisoned(4, 32, torch.float16, device)
        moe_gemv_int4_kblock(a, g, ids, out, a_row_div=div, gated=False, topk_weights=tw, k_chunks=2, split_k=2)
        assert int(g.splitk_counters.abs().sum()) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    check_close(outs[1], pair_reference(a, dense, ids, div, False, tw), 4e-3)


def test_moe_gemv_kblock_rejects_bad_arguments(device):
    g, _, _, ids, div, a = pair_case("int4-g128", 3, 32, 256, 1, 2, False, device, seed=1)
    out = torch.empty(2, 32, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="power of two"):
        moe_gemv_int4_kblock(a, g, ids, out, div, False, k_chunks=3)
    with pytest.raises(ValueError, match="split_k"):
        moe_gemv_int4_kblock(a, g, ids, out, div, False, split_k=0)
    with pytest.raises(ValueError, match="out"):
        moe_gemv_int4_kblock(a, g, ids, torch.empty(2, 16, dtype=torch.float16, device=device), div, False)


def _both_projections(weights, d13, d2, tw, ids, hidden, act_in, configs):
    """Gate/up on hidden [T, H] and down on act_in [P, I] in bf16: each K-block config against the
    float64 pair reference and against moe_gemv_int4 (fused_moe's form)."""
    pairs = ids.numel()
    for w, dense, a, div, gated in ((weights.w13, d13, hidden, ids.shape[1], True),
                                    (weights.w2, d2, act_in, 1, False)):
        n = w.n // 2 if gated else w.n
        kw = dict(a_row_div=div, gated=gated, topk_weights=None if gated else tw)
        ref = pair_reference(a, dense, ids, div, gated, tw)
        old = moe_gemv_int4(a, w, ids, poisoned(pairs, n, torch.bfloat16, "cuda"), block_n=16, num_warps=1, **kw)
        for block_n, k_chunks, warps, split_k in configs:
            out = moe_gemv_int4_kblock(a, w, ids, poisoned(pairs, n, torch.bfloat16, "cuda"), block_n=block_n,
                                       k_chunks=k_chunks, num_warps=warps, split_k=split_k, **kw)
            what = f"{'gate/up' if gated else 'down'} {block_n, k_chunks, warps, split_k}"
            check_close(out, ref, 1e-2, what=what)
            check_close(out, old.double(), 1e-2, what=what + " vs moe_gemv_int4")
            assert w.splitk_counters is None or int(w.splitk_counters.abs().sum()) == 0


@pytest.mark.gpu
def test_moe_gemv_kblock_v2_lite_bf16():
    """V2-Lite experts (H 2048, I 1408: 11 chunks, a masked block at K_CHUNKS 16), one token's 8 pairs."""
    _both_projections(*v2_lite_decode_case("int4-g128"),
                      configs=[(16, 16, 4, 1), (16, 8, 4, 2), (32, 16, 8, 1), (16, 4, 2, 3)])


@pytest.mark.gpu
def test_moe_gemv_kblock_v3_bf16():
    """16 V3-shaped experts (gate/up K 7168 = 56 chunks: several blocks a program), 8 pairs."""
    weights, d13, d2 = v3_experts("int4-g128")
    tw, ids = random_topk(1, V3_REDUCED["e"], 8, "cuda")
    hidden = hidden_states(1, V3_REDUCED["hidden"], torch.bfloat16, "cuda", seed=5)
    act_in = hidden_states(8, V3_REDUCED["inter"], torch.bfloat16, "cuda", seed=6)
    _both_projections(weights, d13, d2, tw, ids, hidden, act_in, configs=[(16, 16, 4, 1), (16, 8, 4, 3)])


def test_fused_moe_takes_the_kblock_gemvs(device, monkeypatch):
    """fused_moe at decode size with GEMV_KBLOCK set runs the K-block GEMVs (a spy counts them) and
    equals the float64 expert loop."""
    import dsquant.runtime.kernels.moe.fused_moe as fm
    from dsquant.runtime.kernels.moe.reference_moe import moe_experts_reference
    from tests.kernels.moe_cases import make_experts

    calls = []
    real = fm.moe_gemv_int4_kblock
    monkeypatch.setattr(fm, "moe_gemv_int4_kblock", lambda *a, **k: calls.append(k) or real(*a, **k))
    monkeypatch.setattr(fm, "GEMV_KBLOCK", {"gate_up": (16, 2, 2, 1), "down": (32, 1, 2, 2)})
    weights, d13, d2 = make_experts("int4-g64", 6, 256, 128, torch.float16, device, seed=9)
    hidden = hidden_states(2, 256, torch.float16, device, seed=3)
    tw, ids = random_topk(2, 6, 3, device)
    out = fm.fused_moe(hidden, weights, tw, ids)
    assert [(c["block_n"], c["k_chunks"], c["split_k"]) for c in calls] == [(16, 2, 1), (32, 1, 2)]
    check_close(out, moe_experts_reference(hidden, d13, d2, tw, ids), 4e-3)
