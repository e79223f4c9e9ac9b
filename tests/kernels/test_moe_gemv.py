"""INT4 expert GEMV (decode-sized MoE) against a float64 loop over experts, and against the grouped path.

Split-K (split_k > 1): every split factor, including ones that do not divide the K tiles, gives
the float64 result for the gated and the routed epilogue; outputs poisoned with NaN are fully
written; the per-tile counters are zero after every launch, so a second launch (or a CUDA-graph
replay) reduces again and gives the same bits.
Weights are drawn by tests/realistic_weights.py (moe_cases: group scales over three orders of
magnitude along N and K, outlier input channels, zero rows and a zero tile), the reference is the
dense float64 weight the codes hold, and every check also bounds the worst 128-channel block.
"""
import pytest
import torch

from dsquant.runtime.kernels.moe.fused_moe import fused_moe, pick_configs
from dsquant.runtime.kernels.moe.moe_gemv import (MOE_GEMV_MAX_PAIRS, default_split_k, effective_split,
                                              moe_gemv_int4)
from dsquant.runtime.kernels.moe.reference_moe import moe_experts_reference
from tests.kernels.moe_cases import (V3_REDUCED, check_close, draw_experts, hidden_states, make_experts, pair_case,
                                     pair_reference, poisoned, random_topk, realistic_projection,
                                     v2_lite_decode_case, v2_lite_experts, v3_experts)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("block_n,warps", [(8, 1), (16, 2), (256, 4)])
def test_moe_gemv_projection_matches_dense(group, block_n, warps, device):
    """Routed (down-style) GEMV: out[p] = w_p * a[p] @ W_e^T into a poisoned buffer; N = 208
    (13 x 16) leaves partial 128 and 256 blocks, K = 256 is 2 tiles of 128."""
    e, n, k, t, top_k = 5, 208, 256, 3, 2
    g, dense = realistic_projection(f"int4-g{group}", e, n, k, torch.float16, device, seed=group)
    tw, ids = random_topk(t, e, top_k, device)
    a = hidden_states(t * top_k, k, torch.float16, device, seed=block_n)  # [P, K]
    out = poisoned(t * top_k, n, torch.float16, device)
    moe_gemv_int4(a, g, ids, out, a_row_div=1, gated=False, topk_weights=tw, block_n=block_n,
                  num_warps=warps)
    check_close(out, pair_reference(a, dense, ids, 1, False, tw), 4e-3)


@pytest.mark.parametrize("fmt,t,k", [("int4-g32", 1, 6), ("int4-g64", 2, 3), ("int4-g128", 4, 4),
                                     ("int4ao-g32", 1, 6), ("int4ao-g32", 4, 4)])
def test_fused_moe_gemv_path_matches_reference_and_grouped(fmt, t, k, device, monkeypatch):
    """fused_moe at decode sizes (<= 16 pairs) on the per-pair GEMVs (MOE_PAIR_MMA off, as
    DSQUANT_MOE_PAIR_MMA=0 runs it) equals the float64 expert loop and the grouped-GEMM path."""
    from dsquant.runtime.kernels.moe import fused_moe as fm
    monkeypatch.setattr(fm, "MOE_PAIR_MMA", False)
    assert t * k <= MOE_GEMV_MAX_PAIRS  # these take the GEMV path
    weights, d13, d2 = make_experts(fmt, 8, 256, 128, torch.float16, device, seed=t * 10 + k)
    hidden = hidden_states(t, 256, torch.float16, device, seed=k)
    tw, ids = random_topk(t, 8, k, device)
    shared = torch.randn(t, 256, dtype=torch.float16, device=device)
    out = fused_moe(hidden, weights, tw, ids, shared_output=shared)
    check_close(out, moe_experts_reference(hidden, d13, d2, tw, ids) + shared.double(), 4e-3, what="gemv")
    grouped = fused_moe(hidden, weights, tw, ids, shared_output=shared,
                        configs=pick_configs(t * k, 8, "int4"))
    check_close(out, grouped.double(), 4e-3, what="gemv vs grouped")


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_moe_gemv_split_k_matches_dense(gated, split_k, device):
    """K = 640 is 5 tiles: split 2 runs 3 + 2, split 3 runs 2 + 2 + 1; N = 48 (gated: 2 x 48 rows)
    is 3 blocks of 16; 2 tokens x top-3 = 6 pairs."""
    t, top_k, n = 2, 3, 48
    g, dense, tw, ids, div, a = pair_case("int4-g64", 5, n, 640, t, top_k, gated, device, seed=split_k)
    out = poisoned(t * top_k, n, torch.float16, device)
    moe_gemv_int4(a, g, ids, out, a_row_div=div, gated=gated, topk_weights=None if gated else tw,
                  block_n=16, split_k=split_k)
    check_close(out, pair_reference(a, dense, ids, div, gated, tw), 4e-3)
    assert int(g.splitk_counters.abs().sum()) == 0, "split-K counters must be left zero"
    out8 = poisoned(t * top_k, n, torch.float16, device)  # 8-row programs: half a 16-row weight tile each
    moe_gemv_int4(a, g, ids, out8, a_row_div=div, gated=gated, topk_weights=None if gated else tw,
                  block_n=8, num_warps=1, split_k=split_k)
    check_close(out8, pair_reference(a, dense, ids, div, gated, tw), 4e-3, what="block_n 8")
    assert int(g.splitk_counters.abs().sum()) == 0, "split-K counters must be left zero"


@pytest.mark.parametrize("gated", [True, False])
def test_moe_gemv_split_k_repeated_launch(gated, device):
    """split_k 4 over 5 tiles (2 per split: 3 splits, the last one short). Launched twice on the
    same inputs: the second launch finds the counters reset, writes every element and gives the
    same bits (the partials are summed in split order, whichever program arrives last)."""
    t, top_k, n = 1, 4, 32
    g, dense, tw, ids, div, a = pair_case("int4-g128", 4, n, 640, t, top_k, gated, device, seed=4)
    outs = []
    for _ in range(2):
        out = poisoned(t * top_k, n, torch.float16, device)
        moe_gemv_int4(a, g, ids, out, a_row_div=div, gated=gated, topk_weights=None if gated else tw,
                      block_n=16, split_k=4)
        assert torch.isfinite(out).all() and int(g.splitk_counters.abs().sum()) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    check_close(outs[1], pair_reference(a, dense, ids, div, gated, tw), 4e-3)


def test_split_k_rule():
    """No split is left empty; the default fills the H200 several times at V2-Lite T = 1 shapes
    while keeping >= 2 K tiles per split, and never splits a single-tile K."""
    assert effective_split(8, 11) == 6 and effective_split(4, 16) == 4 and effective_split(9, 3) == 3
    assert default_split_k(8, 1408, 2048, 16) == 2  # gate/up: 704 tiles x 16 K tiles
    assert default_split_k(8, 2048, 1408, 16) == 2  # down: 1024 tiles x 11 K tiles
    assert default_split_k(16, 1408, 2048, 16) == 1
    assert default_split_k(1, 1408, 2048, 16) == 8  # one pair: 88 tiles
    assert default_split_k(4, 64, 128, 16) == 1


def test_moe_gemv_rejects_bad_shapes(device):
    g, _ = realistic_projection("int4-g128", 2, 128, 128, torch.float16, device, seed=0)
    ids = torch.zeros(1, 2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="out"):
        moe_gemv_int4(torch.randn(2, 128, dtype=torch.float16, device=device), g, ids,
                      torch.empty(2, 64, dtype=torch.float16, device=device), 1, False)
    with pytest.raises(ValueError, match="split_k"):
        moe_gemv_int4(torch.randn(2, 128, dtype=torch.float16, device=device), g, ids,
                      torch.empty(2, 128, dtype=torch.float16, device=device), 1, False, split_k=0)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k", [(1, 6), (2, 8)])
def test_moe_gemv_v2_lite_layer_bf16(t, k):
    """V2-Lite experts (64 routed of the 66, H 2048, I 1408) in bf16: the GEMV path equals the
    float64 loop, whole output and per 128-channel block."""
    weights, d13, d2 = v2_lite_experts("int4-g128")
    hidden = hidden_states(t, 2048, torch.bfloat16, "cuda", seed=t)
    tw, ids = random_topk(t, 64, k, "cuda")
    out = fused_moe(hidden, weights, tw, ids)
    check_close(out, moe_experts_reference(hidden, d13, d2, tw, ids), 2e-2)


def _split_k_projections(weights, d13, d2, tw, ids, hidden, act_in, splits):
    """Each projection (gate/up on hidden [T, H], down on act_in [P, I]) with every split_k
    against the float64 pair reference and against split_k 1, launched twice into poisoned
    outputs (the counters must be reset between launches)."""
    pairs = ids.numel()
    for w, dense, a, div, gated in ((weights.w13, d13, hidden, ids.shape[1], True),
                                    (weights.w2, d2, act_in, 1, False)):
        n = w.n // 2 if gated else w.n
        kw = dict(a_row_div=div, gated=gated, topk_weights=None if gated else tw, block_n=16, num_warps=2)
        ref = pair_reference(a, dense, ids, div, gated, tw)  # [P, n]
        one = moe_gemv_int4(a, w, ids, poisoned(pairs, n, torch.bfloat16, "cuda"), split_k=1, **kw)
        check_close(one, ref, 1e-2, what="split_k 1")
        for split_k in splits:
            for _ in range(2):
                out = moe_gemv_int4(a, w, ids, poisoned(pairs, n, torch.bfloat16, "cuda"), split_k=split_k, **kw)
                assert int(w.splitk_counters.abs().sum()) == 0
                check_close(out, ref, 1e-2, what=f"split_k {split_k}")
                check_close(out, one.double(), 1e-2, what=f"split_k {split_k} vs 1")


@pytest.mark.gpu
def test_moe_gemv_split_k_v2_lite_bf16():
    """V2-Lite shapes in bf16 (gate/up: N 2 x 1408, K 2048 = 16 tiles; down: N 2048, K 1408 = 11
    tiles), 8 pairs (T = 1, top-6 + 2 shared): split_k 2, 4, 8 (8: uneven over 11 tiles)."""
    _split_k_projections(*v2_lite_decode_case("int4-g128"), splits=(2, 4, 8))


@pytest.mark.gpu
def test_moe_gemv_split_k_v3_bf16():
    """16 V3-shaped experts in bf16 (gate/up: N 2 x 2048, K 7168 = 56 tiles; down: N 7168,
    K 2048 = 16 tiles), one token's 8 pairs: split_k 3 (uneven) and 8."""
    weights, d13, d2 = v3_experts("int4-g128")
    tw, ids = random_topk(1, V3_REDUCED["e"], 8, "cuda")
    hidden = hidden_states(1, V3_REDUCED["hidden"], torch.bfloat16, "cuda", seed=5)
    act_in = hidden_states(8, V3_REDUCED["inter"], torch.bfloat16, "cuda", seed=6)
    _split_k_projections(weights, d13, d2, tw, ids, hidden, act_in, splits=(3, 8))


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_bench_gemv_sweep_rows_describe_their_config(fmt, device, monkeypatch):
    """bench moe --sweep's GEMV rows (small layer, one config, an explicit and the auto split):
    each names block_n, num_warps, split_k asked for and used per projection, and both times."""
    import dsquant.bench.moe as bench
    from dsquant.runtime.kernels.moe.fused_moe import with_shared_experts

    for name, value in dict(E=4, N_SHARED=1, TOP_K=2, H=256, I=128, GEMV_SWEEP=[(16, 2)],
                            GEMV_SPLITS=[2, None]).items():
        monkeypatch.setattr(bench, name, value)
    dense = tuple(draw_experts("bf16", e, n, k, device, seed=i).squeeze(0).half()
                  for i, (e, n, k) in enumerate([(4, 256, 256), (4, 256, 128), (1, 2 * 128, 256), (1, 256, 128)]))
    layer = bench.build_layer(fmt, dense, device)
    tw, ids = random_topk(1, 4, 2, device)
    routing = [(torch.randn(1, 256, device=device).half(), tw, ids, with_shared_experts(tw, ids, 4, 1))]
    rows = bench._sweep_gemv_rows(fmt, 1, [layer], routing, lambda fn: fn() or 1.0)
    if fmt == "fp8":  # each config also in the elementwise form on an activation quantized once
        assert [r["kernel"] for r in rows] == ["gemv", "gemv_elementwise_prequant"] * 2
        assert rows[1]["config"].startswith("gemv_elementwise_prequant(")
        rows = rows[::2]
    assert [r["split_k"] for r in rows] == [2, "auto"]
    assert rows[0]["split_k_gate_up"] == 2 and rows[0]["split_k_down"] == 1  # down K = 128: one tile
    assert all(r["block_n"] == 16 and r["num_warps"] == 2 and r["gate_up_us"] == 1.0 == r["down_us"] for r in rows)


@pytest.mark.parametrize("split_k", [1, 2])
def test_moe_gemv_loads_only_reads_every_word(split_k, device):
    """The LOADS_ONLY timing variant (scripts/moe_gemv_probe.py) loads every weight word of its
    pairs' rows: with small integers as words, each output is the sum of its row's words (weight
    layout [E, N/16, K/128, 16, 16], moe_gemv's docstring), so its time covers all the bytes."""
    e, n, k, t, top_k = 4, 48, 384, 2, 2
    g, _ = realistic_projection("int4-g128", e, n, k, torch.float16, device, seed=3)
    words = torch.randint(0, 8, g.weight.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    g.weight.copy_(words.to(g.weight.device))
    _, ids = random_topk(t, e, top_k, device)
    a = hidden_states(t * top_k, k, torch.float16, device)
    out = poisoned(t * top_k, n, torch.float16, device)
    moe_gemv_int4(a, g, ids, out, a_row_div=1, gated=False, block_n=16, num_warps=1, split_k=split_k,
                  _loads_only=True)
    per_row = words.permute(0, 1, 3, 2, 4).reshape(e, n, -1).sum(-1).float()  # [E, N]
    torch.testing.assert_close(out.float().cpu(), per_row[ids.reshape(-1).cpu()], rtol=0, atol=0)
