"""INT4 expert GEMV (decode-sized MoE) against a float64 loop over experts, and against the grouped path.

Split-K (split_k > 1): every split factor, including ones that do not divide the K tiles, gives
the float64 result for the gated and the routed epilogue; outputs poisoned with NaN are fully
written; the per-tile counters are zero after every launch, so a second launch (or a CUDA-graph
replay) reduces again and gives the same bits.
"""
import pytest
import torch

from dsquant.runtime.kernels.fused_moe import fused_moe, pick_configs
from dsquant.runtime.kernels.moe_gemv import (MOE_GEMV_MAX_PAIRS, default_split_k, effective_split,
                                              moe_gemv_int4)
from dsquant.runtime.kernels.reference_moe import moe_experts_reference
from tests.kernels.moe_cases import (make_experts, make_projection, pair_case, pair_reference, random_topk,
                                     rel_err, v2_lite_decode_case)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("block_n,warps", [(16, 2), (256, 4)])
def test_moe_gemv_projection_matches_dense(group, block_n, warps, device):
    """Routed (down-style) GEMV: out[p] = w_p * a[p] @ W_e^T; N = 384 leaves a partial 256 block."""
    e, n, k, t, top_k = 5, 384, 256, 3, 2
    g, dense = make_projection(f"int4-g{group}", torch.randn(e, n, k, device=device) / k ** 0.5, torch.float16)
    tw, ids = random_topk(t, e, top_k, device)
    a = torch.randn(t * top_k, k, dtype=torch.float16, device=device)
    out = torch.full((t * top_k, n), float("nan"), dtype=torch.float16, device=device)
    moe_gemv_int4(a, g, ids, out, a_row_div=1, gated=False, topk_weights=tw, block_n=block_n,
                  num_warps=warps)
    ref = torch.stack([tw.reshape(-1)[p].double() * (a[p].double() @ dense[ids.reshape(-1)[p]].t())
                       for p in range(t * top_k)])
    assert torch.isfinite(out).all()
    assert rel_err(out, ref.to(out.device)) < 4e-3


@pytest.mark.parametrize("fmt", ["int4-g32", "int4-g64", "int4-g128"])
@pytest.mark.parametrize("t,k", [(1, 6), (4, 4), (2, 3)])
def test_fused_moe_gemv_path_matches_reference_and_grouped(fmt, t, k, device):
    assert t * k <= MOE_GEMV_MAX_PAIRS  # these take the GEMV path
    weights, d13, d2 = make_experts(fmt, 8, 256, 128, torch.float16, device)
    hidden = torch.randn(t, 256, dtype=torch.float16, device=device)
    tw, ids = random_topk(t, 8, k, device)
    shared = torch.randn(t, 256, dtype=torch.float16, device=device)
    out = fused_moe(hidden, weights, tw, ids, shared_output=shared)
    ref = moe_experts_reference(hidden, d13, d2, tw, ids) + shared.double()
    assert torch.isfinite(out).all() and rel_err(out, ref) < 4e-3
    grouped = fused_moe(hidden, weights, tw, ids, shared_output=shared,
                        configs=pick_configs(t * k, 8, "int4", weights.w13.group_size, 128, 256))
    assert rel_err(out, grouped.double()) < 4e-3


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_moe_gemv_split_k_matches_dense(gated, split_k, device):
    """K = 640 is 5 tiles: split 2 runs 3 + 2, split 3 runs 2 + 2 + 1; N = 48 (gated: 2 x 48 rows)
    is 3 blocks of 16; 2 tokens x top-3 = 6 pairs."""
    t, top_k, n = 2, 3, 48
    g, dense, tw, ids, div, a = pair_case("int4-g64", 5, n, 640, t, top_k, gated, device)
    out = torch.full((t * top_k, n), float("nan"), dtype=torch.float16, device=device)
    moe_gemv_int4(a, g, ids, out, a_row_div=div, gated=gated, topk_weights=None if gated else tw,
                  block_n=16, split_k=split_k)
    assert torch.isfinite(out).all(), "some output element was not written"
    assert rel_err(out, pair_reference(a, dense, ids, div, gated, tw)) < 4e-3
    assert int(g.splitk_counters.abs().sum()) == 0, "split-K counters must be left zero"


@pytest.mark.parametrize("gated", [True, False])
def test_moe_gemv_split_k_repeated_launch(gated, device):
    """split_k 4 over 5 tiles (2 per split: 3 splits, the last one short). Launched twice on the
    same inputs: the second launch finds the counters reset, writes every element and gives the
    same bits (the partials are summed in split order, whichever program arrives last)."""
    t, top_k, n = 1, 4, 32
    g, dense, tw, ids, div, a = pair_case("int4-g128", 4, n, 640, t, top_k, gated, device)
    outs = []
    for _ in range(2):
        out = torch.full((t * top_k, n), float("nan"), dtype=torch.float16, device=device)
        moe_gemv_int4(a, g, ids, out, a_row_div=div, gated=gated, topk_weights=None if gated else tw,
                      block_n=16, split_k=4)
        assert torch.isfinite(out).all() and int(g.splitk_counters.abs().sum()) == 0
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[1], pair_reference(a, dense, ids, div, gated, tw)) < 4e-3


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
    g, _ = make_projection("int4-g128", torch.randn(2, 128, 128, device=device), torch.float16)
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
    """V2-Lite expert shapes (64 experts, H 2048, I 1408) in bf16: GEMV path vs float64 loop."""
    weights, d13, d2 = make_experts("int4-g128", 64, 2048, 1408, torch.bfloat16, "cuda")
    hidden = torch.randn(t, 2048, dtype=torch.bfloat16, device="cuda")
    tw, ids = random_topk(t, 64, k, "cuda")
    out = fused_moe(hidden, weights, tw, ids)
    assert torch.isfinite(out).all()
    assert rel_err(out, moe_experts_reference(hidden, d13, d2, tw, ids)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [2, 4, 8])
def test_moe_gemv_split_k_v2_lite_bf16(split_k):
    """V2-Lite shapes in bf16 (gate/up: N 2 x 1408, K 2048 = 16 tiles; down: N 2048, K 1408 = 11
    tiles), 8 pairs (T = 1, top-6 + 2 shared): each projection with split-K against the float64
    reference and against split_k 1, twice (counters reset between launches)."""
    weights, d13, d2, tw, ids, hidden, act_in = v2_lite_decode_case("int4-g128")
    for w, dense, a, div, gated, n in ((weights.w13, d13, hidden, 8, True, 1408),
                                       (weights.w2, d2, act_in, 1, False, 2048)):
        kw = dict(a_row_div=div, gated=gated, topk_weights=None if gated else tw, block_n=16, num_warps=2)
        one = moe_gemv_int4(a, w, ids, torch.empty(8, n, dtype=torch.bfloat16, device="cuda"), split_k=1, **kw)
        for _ in range(2):
            out = torch.full((8, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            moe_gemv_int4(a, w, ids, out, split_k=split_k, **kw)
            assert torch.isfinite(out).all() and int(w.splitk_counters.abs().sum()) == 0
            assert rel_err(out, pair_reference(a, dense, ids, div, gated, tw)) < 1e-2
            assert rel_err(out, one.double()) < 1e-2


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_bench_gemv_sweep_rows_describe_their_config(fmt, device, monkeypatch):
    """bench moe --sweep's GEMV rows (small layer, one config, an explicit and the auto split):
    each names block_n, num_warps, split_k asked for and used per projection, and both times."""
    import dsquant.bench.moe as bench
    from dsquant.runtime.kernels.fused_moe import with_shared_experts

    for name, value in dict(E=4, N_SHARED=1, TOP_K=2, H=256, I=128, GEMV_SWEEP=[(16, 2)],
                            GEMV_SPLITS=[2, None]).items():
        monkeypatch.setattr(bench, name, value)
    dense = (torch.randn(4, 256, 256, device=device).half() / 16, torch.randn(4, 256, 128, device=device).half() / 16,
             torch.randn(2 * 128, 256, device=device).half() / 16, torch.randn(256, 128, device=device).half() / 16)
    layer = bench.build_layer(fmt, dense, device)
    tw, ids = random_topk(1, 4, 2, device)
    routing = [(torch.randn(1, 256, device=device).half(), tw, ids, with_shared_experts(tw, ids, 4, 1))]
    rows = bench._sweep_gemv_rows(fmt, 1, [layer], routing, lambda fn: fn() or 1.0)
    assert [r["split_k"] for r in rows] == [2, "auto"]
    assert rows[0]["split_k_gate_up"] == 2 and rows[0]["split_k_down"] == 1  # down K = 128: one tile
    assert all(r["block_n"] == 16 and r["num_warps"] == 2 and r["gate_up_us"] == 1.0 == r["down_us"] for r in rows)
