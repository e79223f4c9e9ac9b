"""Fused MoE (align + grouped GEMMs + sum) against a float64 loop over experts, every format.

Weights come from tests/realistic_weights.py through moe_cases (block / group scales over three
orders of magnitude, outlier input channels, zero rows and tiles); the reference is the dense
float64 weight the quantized tensors hold, and every check also bounds the worst block of 128
output channels. CPU: fp16 under TRITON_INTERPRET=1 with bf16 and fp8 at H = 200 (partial 128
blocks along N and K); INT4 needs H and I multiples of 128. GPU: V2-Lite and V3 expert shapes, bf16.
"""
import pytest
import torch

from dsquant.formats.awq_gemm import dequantize_awq
from dsquant.runtime.kernels.moe.fused_moe import (fused_moe, pick_configs, split_shared_experts,
                                               with_shared_experts, MoeWeights, bf16_experts)
from dsquant.models.routing import RoutingConfig, route
from dsquant.runtime.kernels.moe.fused_moe_fp8 import quantize_act_fp8, quantize_act_fp8_torch
from dsquant.runtime.kernels.moe.fused_moe_int4 import dequantize_int4_experts, int4_experts_from_awq
from dsquant.runtime.kernels.gemm.fp8_quant import per_token_group_quant_fp8
from dsquant.runtime.kernels.moe.moe_align import moe_align_block_size, one_block_per_pair
from dsquant.runtime.kernels.moe.moe_gemm import GemmConfig, moe_gemm
from dsquant.runtime.kernels.moe.reference_moe import moe_experts_reference
from tests.kernels.moe_cases import (FORMATS, V2_LITE, V3_REDUCED, awq_stack, check_close, draw_experts,
                                     hidden_states, int4_codes, make_experts, make_projection, pair_reference,
                                     poisoned, random_topk, realistic_projection, v2_lite_experts, v3_experts)
from tests.realistic_weights import realistic_weight

E, H, I = 8, 128, 128  # the INT4 CPU shape: int4 needs H and I multiples of 128
PARTIAL_H = 200  # bf16 / fp8 CPU hidden size: 1 full + 1 partial 128 block (fp8 needs I % 128 == 0)
BF16_I = 96  # bf16 CPU intermediate: no block divides 96 or 200


def _shape(fmt):
    """(H, I) of the CPU cases for `fmt`: partial blocks wherever the format allows them."""
    if fmt == "bf16":
        return PARTIAL_H, BF16_I
    return (PARTIAL_H, I) if fmt == "fp8" else (H, I)


def _tol(fmt, dtype):
    # fp8: the SiLU-and-mul output is re-quantized to fp8, so a 1-ulp bf16 difference in gate/up
    # (accumulation order) can move an intermediate fp8 code by 1/16. On the H200 at T = 1 the
    # error against the float64 reference ranged 0.002-0.021 over 7 draws; a reference without
    # activation quantization is 0.043 away, so 3e-2 still tells the two apart. With the
    # realistic weights (H200, bf16, V2-Lite / V3 shapes): 0.011-0.017 whole, worst 128-channel
    # block 0.016-0.035 (T = 1: one token's block), hence 3 x tol for the blocks; a wrong scale
    # layout is O(1) off. bf16 / int4 there: at most 0.0053 whole, 0.0062 per block.
    if fmt == "fp8":
        return 3e-2
    return 2e-2 if dtype == torch.bfloat16 else 4e-3


def _check(fmt, weights, d13, d2, hidden, tw, ids, configs=None, shared=None):
    out = fused_moe(hidden, weights, tw, ids, shared_output=shared, configs=configs)
    assert out.shape == hidden.shape
    ref = moe_experts_reference(hidden, d13, d2, tw, ids, fp8_acts=fmt == "fp8")
    if shared is not None:
        ref = ref + shared.double()
    tol = _tol(fmt, hidden.dtype)
    check_close(out, ref, tol, block_tol=(3 if fmt == "fp8" else 2) * tol, what=fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("t,k", [(1, 2), (7, 3), (33, 2)])
def test_fused_moe_matches_reference(fmt, t, k, device):
    """fused_moe equals the float64 expert loop on the dense weights, whole output and per
    128-channel block, for every format (int4 T = 1 on the GEMV path, the rest grouped)."""
    h, inter = _shape(fmt)
    weights, d13, d2 = make_experts(fmt, E, h, inter, torch.float16, device, seed=t)
    hidden = hidden_states(t, h, torch.float16, device, seed=t)
    _check(fmt, weights, d13, d2, hidden, *random_topk(t, E, k, device))


@pytest.mark.parametrize("fmt", ["int4-g128", "int4-g32"])
def test_int4_pairs_past_the_down_pair_limit(fmt, device):
    """12 pairs (3 tokens x top-4): gate/up on the pair MMA, down (past PAIR_MMA_DOWN_MAX_PAIRS) on the
    grouped GEMM one block per pair; equals the float64 loop."""
    from dsquant.runtime.kernels.moe import fused_moe as fm
    assert fm.PAIR_MMA_DOWN_MAX_PAIRS < 12 <= fm.MOE_GEMV_MAX_PAIRS
    h, inter = _shape(fmt)
    weights, d13, d2 = make_experts(fmt, E, h, inter, torch.float16, device, seed=41)
    hidden = hidden_states(3, h, torch.float16, device, seed=41)
    _check(fmt, weights, d13, d2, hidden, *random_topk(3, E, 4, device))


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("t", [1, 2])
def test_decode_rules_on_match_reference(fmt, t, monkeypatch, device):
    """With the one-block-per-pair and in-GEMM fp8 quant rules switched on up to 2 tokens,
    fused_moe still equals the float64 loop (on CPU the fp8 activations are quantized by torch;
    the in-kernel quant is the GPU test's)."""
    from dsquant.runtime.kernels.moe import fused_moe as fm
    monkeypatch.setattr(fm, "ONE_BLOCK_PER_PAIR_MAX_TOKENS", 2)
    monkeypatch.setattr(fm, "FP8_FUSE_QUANT_MAX_TOKENS", 2)
    h, inter = _shape(fmt)
    weights, d13, d2 = make_experts(fmt, E, h, inter, torch.float16, device, seed=10 + t)
    hidden = hidden_states(t, h, torch.float16, device, seed=10 + t)
    _check(fmt, weights, d13, d2, hidden, *random_topk(t, E, 3, device))


@pytest.mark.parametrize("fmt", ["bf16", "int4-g64", "fp8"])
def test_experts_without_tokens(fmt, device):
    """16 experts, only 3 of them receive pairs: the other blocks must not be computed or written."""
    h, inter = _shape(fmt)
    weights, d13, d2 = make_experts(fmt, 16, h, inter, torch.float16, device, seed=16)
    hidden = hidden_states(9, h, torch.float16, device)
    _check(fmt, weights, d13, d2, hidden, *random_topk(9, 16, 2, device, experts=[3, 7, 15]))


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
def test_every_routing_method_end_to_end(method, device):
    """route() then fused_moe (int4-g32) equals the float64 loop for each routing method."""
    weights, d13, d2 = make_experts("int4-g32", 16, H, I, torch.float16, device, seed=3)
    hidden = hidden_states(11, H, torch.float16, device)
    scoring = "sigmoid" if method == "noaux_tc" else "softmax"
    cfg = RoutingConfig(16, 4, scoring, method, 4, 2, method == "noaux_tc", 2.5)
    gate = realistic_weight(16, H, seed=5, tile=(4, 64), device=device)  # router [E, H]
    tw, ids = route(hidden, gate, cfg, torch.randn(16, device=device))
    _check("int4-g32", weights, d13, d2, hidden, tw, ids)


def test_one_token_routed_to_every_group(device):
    """One token whose 4 experts lie in 4 different expert groups (blocks of 4 ids)."""
    weights, d13, d2 = make_experts("bf16", 16, H, I, torch.float16, device, seed=4)
    hidden = hidden_states(1, H, torch.float16, device)
    ids = torch.tensor([[1, 6, 11, 12]], device=device)  # one expert in each group of 4
    _check("bf16", weights, d13, d2, hidden, torch.rand(1, 4, device=device), ids)


@pytest.mark.parametrize("cfg", [GemmConfig(16, 32, 32, 4, 2), GemmConfig(32, 64, 64, 4, 3),
                                 GemmConfig(64, 16, 128, 4, 2)])
def test_ragged_dims_and_block_sizes(cfg, device):
    """bf16 with H and I that no block divides: partial n and k tiles at every edge."""
    weights, d13, d2 = make_experts("bf16", 6, 96, 40, torch.float16, device, seed=6)
    hidden = hidden_states(13, 96, torch.float16, device)
    _check("bf16", weights, d13, d2, hidden, *random_topk(13, 6, 2, device), configs=(cfg, cfg))


def test_shared_experts_both_ways(device):
    """2 shared experts as a passed-in output and as extra always-selected experts agree."""
    weights, d13, d2 = make_experts("bf16", E, H, I, torch.float16, device, seed=8)
    gate_up = draw_experts("bf16", 1, 2 * 2 * I, H, device, seed=9)[0].half()  # shared MLP [4I, H], inter 2I
    down = draw_experts("bf16", 1, H, 2 * I, device, seed=10)[0].half()  # [H, 2I]
    hidden = hidden_states(5, H, torch.float16, device)
    g, u = (hidden.double() @ gate_up.double().t()).chunk(2, -1)
    shared = ((torch.nn.functional.silu(g) * u) @ down.double().t())  # float64 [T, H]
    tw, ids = random_topk(5, E, 2, device)
    _check("bf16", weights, d13, d2, hidden, tw, ids, shared=shared.half())
    s13, s2 = split_shared_experts(gate_up, down, 2)
    both = MoeWeights(bf16_experts(torch.cat([weights.w13.weight, s13])),
                      bf16_experts(torch.cat([weights.w2.weight, s2])))
    out = fused_moe(hidden, both, *with_shared_experts(tw, ids, E, 2), n_shared=2)
    check_close(out, moe_experts_reference(hidden, d13, d2, tw, ids) + shared, 4e-3, what="folded shared")


@pytest.mark.parametrize("fmt", ["bf16", "int4-g128", "fp8"])
@pytest.mark.parametrize("t", [1, 9])
def test_residual_and_shared_output_added_in_the_sum(fmt, t, device):
    """fused_moe(..., shared_output, residual) = residual + (experts + shared_output), the adds
    done by the sum launch (T = 1 takes the INT4 GEMV path, T = 9 the grouped GEMMs)."""
    h, inter = _shape(fmt)
    weights, d13, d2 = make_experts(fmt, E, h, inter, torch.float16, device, seed=11)
    hidden = hidden_states(t, h, torch.float16, device)
    shared, residual = torch.randn(2, t, h, dtype=torch.float16, device=device)
    tw, ids = random_topk(t, E, 2, device)
    plain = fused_moe(hidden, weights, tw, ids)
    out = fused_moe(hidden, weights, tw, ids, shared_output=shared, residual=residual)
    torch.testing.assert_close(out, residual + (plain + shared))
    check_close(out - residual, moe_experts_reference(hidden, d13, d2, tw, ids, fp8_acts=fmt == "fp8")
                + shared.double(), _tol(fmt, hidden.dtype), what=fmt)


def _gemm_into_poisoned(a, w, align, cfg, n_out, a_row_div, gated, tw=None, a_s=None):
    """One moe_gemm into a NaN-poisoned fp16 [P + 1, n_out] buffer; the extra row must stay NaN.
    Returns the P pair rows."""
    out = poisoned(align.num_pairs + 1, n_out, torch.float16, a.device)
    moe_gemm(a, w, align, out, cfg, a_row_div=a_row_div, gated=gated, topk_weights=tw, a_scale=a_s,
             fp8_upcast=a.device.type == "cpu")
    assert torch.isnan(out[-1]).all(), "a row past the last pair was written"
    return out[:-1]


def _fp8_input(x, fmt):
    """(kernel input, its scale, the float64 values the kernel multiplies) for `fmt`; fp8: the
    codes x scales of quantize_act_fp8 (the Triton quantizer on the GPU, torch's on the CPU)."""
    if fmt != "fp8":
        return x, None, x.double()
    q, s = quantize_act_fp8(x)  # [rows, K] e4m3, [rows, ceil(K/128)]
    return q, s, q.double() * s.double().repeat_interleave(128, 1)[:, : x.shape[1]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_grouped_gemm_writes_every_pair_row(fmt, device):
    """Poisoned outputs: both GEMMs write every (token, expert) row and no other, and each row
    equals the float64 pair product of the inputs the kernel consumed (gate/up then SiLU-and-mul;
    down times the routing weight), per 128-channel block; bf16 / fp8 at H = 200."""
    h, inter = _shape(fmt)
    weights, d13, d2 = make_experts(fmt, E, h, inter, torch.float16, device, seed=12)
    t, k = 6, 3
    tw, ids = random_topk(t, E, k, device)
    cfg, _ = pick_configs(t * k, E, fmt.split("-g")[0])
    align = moe_align_block_size(ids, E, cfg.block_m)
    a, a_s, a_ref = _fp8_input(hidden_states(t, h, torch.float16, device), fmt)  # [T, H]
    act = _gemm_into_poisoned(a, weights.w13, align, cfg, inter, k, gated=True, a_s=a_s)  # [P, I]
    check_close(act, pair_reference(a_ref, d13, ids, k, gated=True), 4e-3, what="gate/up")
    a, a_s, a_ref = _fp8_input(act, fmt)
    out = _gemm_into_poisoned(a, weights.w2, align, cfg, h, 1, gated=False, tw=tw, a_s=a_s)  # [P, H]
    check_close(out, pair_reference(a_ref, d2, ids, 1, gated=False, tw=tw), 4e-3, what="down")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("t,k", [(1, 4), (5, 3)])
def test_grouped_gemm_one_block_per_pair(fmt, t, k, device):
    """moe_align.one_block_per_pair (no align launch, block b = pair b): both GEMMs write every
    pair row and no other, each the float64 pair product; T = 5 repeats experts across tokens
    (each pair then reads its expert again: still exact)."""
    h, inter = _shape(fmt)
    weights, d13, d2 = make_experts(fmt, E, h, inter, torch.float16, device, seed=20 + t)
    tw, ids = random_topk(t, E, k, device)
    cfg, _ = pick_configs(t * k, E, fmt.split("-g")[0])
    align = one_block_per_pair(ids, cfg.block_m)
    assert align.expert_ids.shape[0] == t * k and align.one_block_per_pair
    a, a_s, a_ref = _fp8_input(hidden_states(t, h, torch.float16, device, seed=t), fmt)  # [T, H]
    act = _gemm_into_poisoned(a, weights.w13, align, cfg, inter, k, gated=True, a_s=a_s)  # [P, I]
    check_close(act, pair_reference(a_ref, d13, ids, k, gated=True), 4e-3, what="gate/up")
    a, a_s, a_ref = _fp8_input(act, fmt)
    out = _gemm_into_poisoned(a, weights.w2, align, cfg, h, 1, gated=False, tw=tw, a_s=a_s)  # [P, H]
    check_close(out, pair_reference(a_ref, d2, ids, 1, gated=False, tw=tw), 4e-3, what="down")


@pytest.mark.parametrize("pair_blocks", [True, False])
def test_fp8_grouped_gemm_quantizes_activations_in_kernel(pair_blocks, device):
    """fp8 experts with a bf16/fp16 a and no a_scale (A_QUANT): the kernel's per-tile quantization
    gives the product of a as the Triton quantizer (per_token_group_quant_fp8, the same
    quant_group_fp8) rounds it, at H = 200 (a partial 128 block) with the rows read from NaN-padded
    buffers (a tile reading past K turns NaN); on CPU the interpreter mis-rounds in-kernel fp8
    casts, but both kernels share that rounding. An fp8 a without scales is refused."""
    h, inter = _shape("fp8")
    weights, d13, d2 = make_experts("fp8", E, h, inter, torch.float16, device, seed=31)
    t, k = (1, 4) if pair_blocks else (6, 3)
    tw, ids = random_topk(t, E, k, device)
    cfg, _ = pick_configs(t * k, E, "fp8")
    align = one_block_per_pair(ids, cfg.block_m) if pair_blocks else moe_align_block_size(ids, E, cfg.block_m)
    for w, n_out, rows, width, div, gated in ((weights.w13, inter, t, h, k, True),
                                              (weights.w2, h, t * k, inter, 1, False)):
        buf = torch.full((rows, width + 256), float("nan"), dtype=torch.float16, device=device)
        buf[:, :width] = hidden_states(rows, width, torch.float16, device, seed=rows)
        a = buf[:, :width]
        q, s = per_token_group_quant_fp8(a)
        a_ref = q.double() * s.double().repeat_interleave(128, 1)[:, :width]
        out = _gemm_into_poisoned(a, w, align, cfg, n_out, div, gated, None if gated else tw)
        ref = pair_reference(a_ref, d13 if gated else d2, ids, div, gated, None if gated else tw)
        check_close(out, ref, 4e-3, what="gate/up" if gated else "down")
    with pytest.raises(ValueError, match="float8_e4m3fn a with a_scale"):
        moe_gemm(q, weights.w2, align, torch.empty(t * k, h, device=device), cfg, 1, False)


@pytest.mark.parametrize("gated", [True, False])
def test_grouped_gemm_int4_partial_n(gated, device):
    """INT4 grouped GEMM with N = 208 (13 chunks of 16, no multiple of 64 or 128: partial
    BLOCK_N and 128-channel blocks; gated: the up rows start mid-tile at row 104), K = 256."""
    t, k, e = 5, 2, 4
    n_rows, n_out = 208, 104 if gated else 208
    g, dense = realistic_projection("int4-g64", e, n_rows, 256, torch.float16, device, seed=13)
    tw, ids = random_topk(t, e, k, device)
    cfg = GemmConfig(16, 64, 128, 4, 2)
    align = moe_align_block_size(ids, e, cfg.block_m)
    a = hidden_states(t if gated else t * k, 256, torch.float16, device, seed=14)
    out = _gemm_into_poisoned(a, g, align, cfg, n_out, k if gated else 1, gated, None if gated else tw)
    ref = pair_reference(a, dense, ids, k if gated else 1, gated, tw)  # [P, n_out]
    check_close(out, ref, 4e-3, what="int4 partial N")


def test_fused_moe_names_mismatched_hidden(device):
    weights, _, _ = make_experts("bf16", 4, 64, 32, torch.float16, device)
    with pytest.raises(ValueError, match="hidden size"):
        fused_moe(torch.randn(2, 96, dtype=torch.float16, device=device), weights,
                  *random_topk(2, 4, 2, device))


GPU_FORMATS = ["bf16", "int4-g128", "int4-g64", "int4ao-g128", "fp8"]


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 8, 517, 4096])
@pytest.mark.parametrize("fmt", GPU_FORMATS)  # the slowest-varying parameter: one cached format at a time
def test_fused_moe_v2_lite_bf16_full_size(fmt, t, device):
    """DeepSeek-V2-Lite layer: 64 experts + 2 shared run as experts, top-6, H 2048, I 1408, bf16:
    fused_moe equals the float64 loop, whole output and per 128-channel block (INT4: T = 1 on the
    pair MMAs, T = 2 gate/up on the pair MMA and down on the grouped GEMM, 8 and 517 on the grouped
    GEMMs, 4096 dequantized first)."""
    weights, d13, d2 = v2_lite_experts(fmt)
    hidden = hidden_states(t, V2_LITE["hidden"], torch.bfloat16, device, seed=t)
    tw, ids = with_shared_experts(*random_topk(t, 64, 6, device, seed=t), 64, 2)
    _check(fmt, weights, d13, d2, hidden, tw, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_fused_moe_v2_lite_decode_rules_on(fmt, t, monkeypatch, device):
    """The V2-Lite layer at decode sizes with both decode rules on (one block per pair, fp8
    activations quantized inside the grouped GEMMs): equals the float64 loop, whole and per block."""
    from dsquant.runtime.kernels.moe import fused_moe as fm
    monkeypatch.setattr(fm, "ONE_BLOCK_PER_PAIR_MAX_TOKENS", 2)
    monkeypatch.setattr(fm, "FP8_FUSE_QUANT_MAX_TOKENS", 2)
    weights, d13, d2 = v2_lite_experts(fmt)
    hidden = hidden_states(t, V2_LITE["hidden"], torch.bfloat16, device, seed=20 + t)
    tw, ids = with_shared_experts(*random_topk(t, 64, 6, device, seed=t), 64, 2)
    _check(fmt, weights, d13, d2, hidden, tw, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 77])
@pytest.mark.parametrize("fmt", ["fp8", "int4-g128"])
def test_fused_moe_v3_shape_bf16(fmt, t, device):
    """DeepSeek-V3 expert shapes (H 7168, I 2048) with 16 of its 256 experts in 4 groups, top-8 of
    the 3 best groups, noaux_tc routing, bf16: fused_moe equals the float64 loop (T = 1 INT4:
    the GEMV path)."""
    e, h = V3_REDUCED["e"], V3_REDUCED["hidden"]
    weights, d13, d2 = v3_experts(fmt)
    hidden = hidden_states(t, h, torch.bfloat16, device, seed=t)
    cfg = RoutingConfig(e, 8, "sigmoid", "noaux_tc", 4, 3, True, 2.5)
    gate = realistic_weight(e, h, seed=7, tile=(4, 128), device=device)  # router [E, H]
    tw, ids = route(hidden, gate, cfg, torch.randn(e, device=device) * 0.1)
    _check(fmt, weights, d13, d2, hidden, tw, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 2048), (4096, 1408), (77, 7168)])
def test_act_quant_kernel_matches_torch(shape, device):
    """The in-kernel fp8 cast (GPU only) against torch's: same scales, codes within one step."""
    x = hidden_states(*shape, torch.bfloat16, device) * 3
    q, s = quantize_act_fp8(x)
    q_ref, s_ref = quantize_act_fp8_torch(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    mismatch = (q.float() != q_ref.float()).float().mean()
    assert mismatch < 1e-3, f"{mismatch:.1e} of the fp8 codes differ from torch's rounding"


@pytest.mark.parametrize("group", [32, 128])
def test_int4_repack_keeps_every_weight(group, device):
    """The tiled INT4 layout dequantises to exactly what the AWQ tensors hold, expert by expert
    (realistic weights: group scales differ along N and K, so a transposed scale shows)."""
    w = draw_experts(f"int4-g{group}", 3, 48, 256, device, seed=group)
    qweight, qzeros, scales = awq_stack(*int4_codes(w, group), torch.float16)
    packed = int4_experts_from_awq(qweight, qzeros, scales, group)
    expected = torch.stack([dequantize_awq(qweight[e], qzeros[e], scales[e], group) for e in range(3)])
    assert torch.equal(dequantize_int4_experts(packed), expected)
    _, dense = make_projection(f"int4-g{group}", w, torch.float16)
    assert torch.equal(expected.double(), dense)  # the codec and moe_cases' reference agree
    with pytest.raises(ValueError, match="in_features % 128"):
        int4_experts_from_awq(*awq_stack(*int4_codes(w[:, :, :192], 64), torch.float16), 64)


def test_int4_paired_order_nibbles():
    """The kernels' paired order, word by word: nibble j of word i of row r in tile t holds
    W[r, 128t + 32 (j % 4) + 2i + j // 4], so nibbles j and j + 4 are neighbouring channels."""
    e, n, k = 2, 32, 256
    codes = torch.randint(0, 16, (e, n, k), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    s = torch.ones(e, n, k // 128)
    z = torch.full((e, n, k // 128), 8, dtype=torch.int32)
    words = int4_experts_from_awq(*awq_stack(codes, s, z, torch.float16), 128).weight  # [E, N/16, K/128, 16, 16]
    t, c = torch.arange(k) // 128, torch.arange(k) % 128
    j = (c // 32) + 4 * (c % 2)  # nibble
    i = (c % 32) // 2  # word
    for ex in range(e):
        for r in range(n):
            got = (words[ex, r // 16, t, r % 16, i] >> (4 * j)) & 0xF  # [K]
            assert torch.equal(got, codes[ex, r]), (ex, r)
