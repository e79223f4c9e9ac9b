"""Expert weights drawn like trained ones (tests/realistic_weights.py) in every format, the dense
float64 values the quantized tensors hold, and the checks, for the MoE tests.

The dense reference is rebuilt from the quantizer's own codes and scales (FP8: codes x block
scale; INT4: (code - zero) x group scale as stored), not through the runtime's dequantizers, so a
scale laid out wrongly by a repack cannot reach the reference too. Each projection is scaled to a
mean row norm of 1 (one factor for the whole stack: the tile-to-tile spread, outliers and zero
rows and tiles stay), so fp16 intermediates do not overflow at small K.
"""
import functools

import torch

from dsquant.formats.awq_gemm import to_awq_tensors
from dsquant.formats.fp8_block import quantize_fp8_block
from dsquant.formats.int_grid import quantize_int_groupwise
from dsquant.runtime.kernels.moe.fused_moe import MoeWeights, bf16_experts
from dsquant.runtime.kernels.moe.fused_moe_fp8 import fp8_experts
from dsquant.runtime.kernels.moe.fused_moe_int4 import int4_experts, int4_experts_from_awq
from tests.realistic_weights import FP8_TILE, max_block_rel_err, realistic_activations, realistic_weight

# "int4ao-gG": act-order GPTQ experts (each expert's groups are a random permutation of its input channels)
FORMATS = ["bf16", "int4-g32", "int4-g64", "int4-g128", "int4ao-g64", "fp8"]
INT4_TILE_ROWS = 16  # rows per random factor of an INT4 weight: group scales vary along N too
BF16_TILE = (16, 64)


def group_of(fmt: str) -> int:
    return int(fmt.split("-g")[1])


def weight_tile(fmt: str) -> tuple[int, int]:
    """realistic_weight's tile for a format: one factor per FP8 block, per 16 rows x one INT4
    group, or per 16 x 64 for bf16."""
    if fmt == "fp8":
        return FP8_TILE
    if fmt.startswith("int4"):
        return INT4_TILE_ROWS, group_of(fmt)
    return BF16_TILE


def draw_experts(fmt: str, e: int, n: int, k: int, device, seed: int) -> torch.Tensor:
    """float32 [E, N, K] on `device`: realistic_weight with `fmt`'s tile, mean row norm 1
    (drawn on the GPU when `device` is one: full-size stacks take a minute on the CPU). The
    zero tile is left out of matrices of fewer than 4 tiles (small FP8 cases), where it would
    zero a whole gate or up half, or the whole matrix."""
    tn, tk = weight_tile(fmt)
    tiles = -(-n // tn) * -(-k // tk)
    draw_on = device if torch.device(device).type == "cuda" else None
    w = realistic_weight(e, n, k, seed=seed, tile=(tn, tk), zero_tiles=1 if tiles >= 4 else 0, device=device,
                         draw_device=draw_on)
    return w / w.pow(2).sum(-1).mean().sqrt()


def int4_codes(w: torch.Tensor, group: int):
    """w [E, N, K] -> the quantizer's (codes [E, N, K], scales fp32 [E, N, K/G], zeros [E, N, K/G])."""
    per_expert = [quantize_int_groupwise(w[e].float(), group) for e in range(w.shape[0])]
    return tuple(torch.stack([p[i] for p in per_expert]) for i in range(3))


def _int4(w: torch.Tensor, group: int, dtype, act_order: bool = False):
    """w [E, N, K] -> (GroupedWeight("int4"), float64 [E, N, K] from the codes and stored scales).
    act_order: as GPTQ with desc_act, each expert's groups are runs of a random permutation perm of its
    input channels (group of channel perm[j] is j // G), built through int4_experts with that perm."""
    perm = None
    if act_order:
        gen = torch.Generator().manual_seed(w.shape[1] * 7 + w.shape[2])
        perm = torch.stack([torch.randperm(w.shape[2], generator=gen) for _ in range(w.shape[0])]).to(w.device)
        w = torch.gather(w, 2, perm[:, None, :].expand_as(w))  # column j: channel perm[j]
    q, s, z = int4_codes(w, group)
    s = s.to(dtype)  # the scales as stored (the activation dtype)
    dense = (q.double() - z.double().repeat_interleave(group, -1)) * s.double().repeat_interleave(group, -1)
    if perm is None:
        return int4_experts_from_awq(*awq_stack(q, s, z, dtype), group), dense
    g = int4_experts(q, z.transpose(1, 2), s.transpose(1, 2), group, perm=perm)
    return g, torch.empty_like(dense).scatter_(2, perm[:, None, :].expand_as(dense), dense)


def awq_stack(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, dtype):
    """Codes [E, N, K], scales / zeros [E, N, K/G] -> stacked AWQ gemm tensors
    (qweight [E, K, N/8], qzeros [E, K/G, N/8], scales [E, K/G, N])."""
    per_expert = [to_awq_tensors(q[e], s[e], z[e], dtype=dtype) for e in range(q.shape[0])]
    return [torch.stack([p[i] for p in per_expert]) for i in range(3)]


def _fp8(w: torch.Tensor):
    """w [E, N, K] -> (GroupedWeight("fp8"), float64 [E, N, K] = codes x block scale)."""
    per_expert = [quantize_fp8_block(w[e]) for e in range(w.shape[0])]
    q = torch.stack([p[0] for p in per_expert])  # [E, N, K] e4m3
    s = torch.stack([p[1] for p in per_expert])  # [E, ceil(N/128), ceil(K/128)]
    n, k = q.shape[1:]
    dense = q.double()  # expert by expert below: one float64 [E, N, K] at the V3 shape, not three
    for e in range(q.shape[0]):
        dense[e] *= s[e].double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return fp8_experts(q, s), dense


def make_projection(fmt: str, w: torch.Tensor, dtype):
    """Dense w [E, N, K] -> (GroupedWeight in `fmt`, the dense values it holds, float64 [E, N, K])."""
    if fmt == "bf16":
        g = bf16_experts(w.to(dtype))
        return g, g.weight.double()
    if fmt.startswith("int4"):
        return _int4(w, group_of(fmt), dtype, act_order=fmt.startswith("int4ao"))
    return _fp8(w)


def realistic_projection(fmt: str, e: int, n: int, k: int, dtype, device, seed: int):
    """make_projection of a realistic [E, N, K] stack drawn with `fmt`'s tile."""
    return make_projection(fmt, draw_experts(fmt, e, n, k, device, seed), dtype)


def make_experts(fmt: str, e: int, hidden: int, inter: int, dtype, device, seed: int = 0):
    """Realistic experts: (MoeWeights, dense w13 [E, 2I, H], dense w2 [E, H, I]), float64."""
    g13, d13 = realistic_projection(fmt, e, 2 * inter, hidden, dtype, device, seed)
    g2, d2 = realistic_projection(fmt, e, hidden, inter, dtype, device, seed + 1)
    return MoeWeights(g13, g2), d13, d2


def hidden_states(t: int, h: int, dtype, device, seed: int = 0) -> torch.Tensor:
    """[T, H] in `dtype`: N(0, 1) with two outlier channels x 20 (realistic_activations)."""
    return realistic_activations(t, h, seed=seed, device=device, dtype=dtype)


def random_topk(t: int, e: int, k: int, device, experts=None, seed: int | None = None):
    """Distinct experts per token (drawn from `experts` when given) and positive weights; from the
    global RNG, or from `seed` (the same draw whatever ran before, e.g. under xdist)."""
    g = None if seed is None else torch.Generator().manual_seed(seed)
    pool = torch.arange(e) if experts is None else torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(t)])
    return (torch.rand(t, k, generator=g) + 0.1).to(device), ids.to(device)


def pair_reference(a, dense, ids, a_row_div, gated, tw=None):
    """float64 [P, N]: per pair p, a[p // a_row_div] @ W_e^T, then silu(gate) * up or * tw[p]."""
    rows = [a[p // a_row_div].double() @ dense[e].double().t() for p, e in enumerate(ids.reshape(-1).tolist())]
    ref = torch.stack(rows)  # [P, N_rows]
    if gated:
        gate, up = ref.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    return ref * tw.reshape(-1, 1).double()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.to(out.device)).norm() / ref.norm())


def check_close(out: torch.Tensor, ref: torch.Tensor, tol: float, block_tol: float | None = None, what: str = ""):
    """out [..., N] against the float64 ref: finite, relative error over the whole output < tol,
    and over every block of 128 output columns < block_tol (default 2 tol), so an error in a
    block of small weights is not hidden under the norm of the large ones."""
    assert torch.isfinite(out).all(), f"{what}: output has NaN/Inf (some element was not written)"
    err = rel_err(out, ref)
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol:.0e}"
    block_tol = 2 * tol if block_tol is None else block_tol
    worst = max_block_rel_err(out, ref)
    assert worst < block_tol, f"{what}: worst 128-column block relative error {worst:.2e} >= {block_tol:.0e}"


def poisoned(rows: int, n: int, dtype, device) -> torch.Tensor:
    return torch.full((rows, n), float("nan"), dtype=dtype, device=device)


def pair_case(fmt: str, e: int, n: int, k: int, t: int, top_k: int, gated: bool, device,
              dtype=torch.float16, seed: int = 0):
    """A per-pair GEMV case: (weight, dense [E, N or 2N, K], topk_weights, topk_ids, a_row_div, a).
    Gated: w13-style rows (gate then up, 2N) and one activation row per token; else one per pair."""
    g, dense = realistic_projection(fmt, e, 2 * n if gated else n, k, dtype, device, seed)
    tw, ids = random_topk(t, e, top_k, device)
    div = top_k if gated else 1
    return g, dense, tw, ids, div, hidden_states(t * top_k // div, k, dtype, device, seed + 7)


V2_LITE = dict(e=66, hidden=2048, inter=1408)  # 64 routed + 2 shared experts, as experts
V3_REDUCED = dict(e=16, hidden=7168, inter=2048)  # 16 of V3's 256 routed experts


@functools.lru_cache(maxsize=2)
def _v2_lite_experts(fmt: str):
    return make_experts(fmt, V2_LITE["e"], V2_LITE["hidden"], V2_LITE["inter"], torch.bfloat16, "cuda", seed=66)


@functools.lru_cache(maxsize=1)
def _v3_experts(fmt: str):
    return make_experts(fmt, V3_REDUCED["e"], V3_REDUCED["hidden"], V3_REDUCED["inter"], torch.bfloat16, "cuda",
                        seed=3)


def _only_cache(keep, fmt: str):
    """keep(fmt), with the other shape's cached stacks freed first: with 4 test workers on an 80 GB
    H100, a worker holding both (V2-Lite's float64 copies 4.6 GB a format, V3's 5.6 GB) ran the GPU
    out of memory."""
    for cached in (_v2_lite_experts, _v3_experts):
        if cached is not keep and cached.cache_info().currsize:
            cached.cache_clear()
            torch.cuda.empty_cache()
    return keep(fmt)


def v2_lite_experts(fmt: str):
    """V2-Lite experts in `fmt`, bf16, on CUDA: (MoeWeights, d13, d2); cached (drawing and
    quantizing take seconds, and the float64 copies 4.6 GB: keep a test's formats together)."""
    return _only_cache(_v2_lite_experts, fmt)


def v3_experts(fmt: str):
    """16 DeepSeek-V3-shaped experts in `fmt`, bf16, on CUDA (cached; float64 copies 5.6 GB)."""
    return _only_cache(_v3_experts, fmt)


def v2_lite_decode_case(fmt: str):
    """V2-Lite experts (64 routed + 2 shared, H 2048, I 1408) in bf16 on CUDA, one token's 8 pairs:
    (MoeWeights, d13, d2, topk_weights, topk_ids, hidden [1, H], down-projection input [8, I])."""
    weights, d13, d2 = v2_lite_experts(fmt)
    tw, ids = random_topk(1, 66, 8, "cuda")
    return (weights, d13, d2, tw, ids, hidden_states(1, 2048, torch.bfloat16, "cuda", seed=1),
            hidden_states(8, 1408, torch.bfloat16, "cuda", seed=2))
