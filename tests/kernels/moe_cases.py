"""Random expert weights in every format, and their dense float values, for the MoE tests."""
import torch

from dsquant import formats
from dsquant.runtime.kernels.fused_moe import MoeWeights, bf16_experts
from dsquant.runtime.kernels.fused_moe_fp8 import fp8_experts
from dsquant.runtime.kernels.fused_moe_int4 import dequantize_int4_experts, int4_experts_from_awq
from dsquant.runtime.kernels.reference_moe import dequantize_fp8_experts

FORMATS = ["bf16", "int4-g32", "int4-g64", "int4-g128", "fp8"]


def _awq(w: torch.Tensor, group: int, dtype):
    """w [E, N, K] -> stacked AWQ gemm tensors (qweight [E, K, N/8], qzeros, scales)."""
    per_expert = [formats.to_awq_tensors(*formats.quantize_int_groupwise(w[e].float(), group), dtype=dtype)
                  for e in range(w.shape[0])]
    return [torch.stack([p[i] for p in per_expert]) for i in range(3)]


def _fp8(w: torch.Tensor):
    per_expert = [formats.quantize_fp8_block(w[e]) for e in range(w.shape[0])]
    return fp8_experts(torch.stack([q for q, _ in per_expert]), torch.stack([s for _, s in per_expert]))


def make_projection(fmt: str, w: torch.Tensor, dtype):
    """Dense w [E, N, K] -> (GroupedWeight in `fmt`, the dense values it holds, float64 [E, N, K])."""
    if fmt == "bf16":
        g = bf16_experts(w.to(dtype))
        return g, g.weight.double()
    if fmt.startswith("int4"):
        group = int(fmt.split("-g")[1])
        g = int4_experts_from_awq(*_awq(w, group, dtype), group)
        return g, dequantize_int4_experts(g).double()
    g = _fp8(w)
    return g, dequantize_fp8_experts(g.weight, g.scales)


def make_experts(fmt: str, e: int, hidden: int, inter: int, dtype, device):
    """Random experts: (MoeWeights, dense w13 [E, 2I, H], dense w2 [E, H, I])."""
    w13 = torch.randn(e, 2 * inter, hidden, device=device) / hidden ** 0.5
    w2 = torch.randn(e, hidden, inter, device=device) / inter ** 0.5
    g13, d13 = make_projection(fmt, w13, dtype)
    g2, d2 = make_projection(fmt, w2, dtype)
    return MoeWeights(g13, g2), d13, d2


def random_topk(t: int, e: int, k: int, device, experts=None):
    """Distinct experts per token (drawn from `experts` when given) and positive weights."""
    pool = torch.arange(e, device=device) if experts is None else torch.tensor(experts, device=device)
    ids = torch.stack([pool[torch.randperm(len(pool), device=device)[:k]] for _ in range(t)])
    return torch.rand(t, k, device=device) + 0.1, ids


def pair_reference(a, dense, ids, a_row_div, gated, tw=None):
    """float64 [P, N]: per pair p, a[p // a_row_div] @ W_e^T, then silu(gate) * up or * tw[p]."""
    rows = [a[p // a_row_div].double() @ dense[e].double().t() for p, e in enumerate(ids.reshape(-1).tolist())]
    ref = torch.stack(rows)  # [P, N_rows]
    if gated:
        gate, up = ref.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    return ref * tw.reshape(-1, 1).double()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def pair_case(fmt: str, e: int, n: int, k: int, t: int, top_k: int, gated: bool, device, dtype=torch.float16):
    """A per-pair GEMV case: (weight, dense [E, N or 2N, K], topk_weights, topk_ids, a_row_div, a).
    Gated: w13-style rows (gate then up, 2N) and one activation row per token; else one per pair."""
    g, dense = make_projection(fmt, torch.randn(e, 2 * n if gated else n, k, device=device) / k ** 0.5, dtype)
    tw, ids = random_topk(t, e, top_k, device)
    div = top_k if gated else 1
    return g, dense, tw, ids, div, torch.randn(t * top_k // div, k, dtype=dtype, device=device)


def v2_lite_decode_case(fmt: str):
    """V2-Lite experts (64 routed + 2 shared, H 2048, I 1408) in bf16 on CUDA, one token's 8 pairs:
    (MoeWeights, d13, d2, topk_weights, topk_ids, hidden [1, H], down-projection input [8, I])."""
    weights, d13, d2 = make_experts(fmt, 66, 2048, 1408, torch.bfloat16, "cuda")
    tw, ids = random_topk(1, 66, 8, "cuda")
    hidden = torch.randn(1, 2048, dtype=torch.bfloat16, device="cuda")
    return weights, d13, d2, tw, ids, hidden, torch.randn(8, 1408, dtype=torch.bfloat16, device="cuda")

