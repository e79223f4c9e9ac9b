"""Kernel timings behind tune's latency table: one runtime Linear, or one layer's fused routed experts.

Both run the runtime's own code on random weights of the model's shapes (timing does not depend on
the values): a Linear through its quantized-linear method object (runtime/layers/quant.py, processed
as the loader processes it), the routed experts through fused_moe on the grouped weights
runtime/layers/moe.FusedMoE builds. On CUDA the time is the median of CUDA-graph replays, as the
engine decodes (bench/common.time_graph_and_eager: no launch overhead, which the fixed work holds);
on CPU the median of timed calls.
"""
from __future__ import annotations

import statistics
import time

import torch

from dsquant.errors import DsquantError


def _runtime_linear(key: str, n: int, k: int, device: str, dtype: torch.dtype, cpu_mode: str):
    """A runtime QuantLinear of scheme `key` with random weights [N, K], processed as the loader does."""
    from torch import nn

    from dsquant.formats.awq_gemm import to_awq_tensors
    from dsquant.formats.fp8_block import quantize_fp8_block
    from dsquant.formats.int_grid import quantize_int_groupwise
    from dsquant.runtime.layers.linear import QuantLinear
    from dsquant.runtime.layers.quant import AWQMethod, DenseMethod, FP8BlockMethod

    g = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.randn(n, k, generator=g) * 0.02  # [N, K] fp32
    if key == "bf16":
        layer = QuantLinear(DenseMethod(), "tune", k, n, False)
        layer.weight = nn.Parameter(w.to(dtype), requires_grad=False)
    elif key.startswith("awq_g"):
        group = int(key[5:])
        layer = QuantLinear(AWQMethod(group_size=group), "tune", k, n, False)
        q, s, z = quantize_int_groupwise(w, group)
        for name, t in zip(("qweight", "qzeros", "scales"), to_awq_tensors(q, s, z, dtype=torch.bfloat16)):
            setattr(layer, name, nn.Parameter(t, requires_grad=False))
    elif key == "fp8_block":
        layer = QuantLinear(FP8BlockMethod(), "tune", k, n, False)
        wq, ws = quantize_fp8_block(w)
        layer.weight, layer.weight_scale_inv = (nn.Parameter(t, requires_grad=False) for t in (wq, ws))
    else:
        raise DsquantError(f"latency: no timing for scheme {key!r}")
    layer.compute_dtype = dtype
    layer.to(device)
    layer.method.process_weights_after_loading(layer)
    if device != "cuda" and cpu_mode == "dequant" and key != "bf16":
        method = layer.method
        return lambda x: torch.nn.functional.linear(x, method.dequantized_weight(layer, dtype))
    return layer


def _median_us(fn, device: str, min_seconds: float = 0.02) -> float:
    if device == "cuda":
        from dsquant.bench.common import time_graph_and_eager

        return time_graph_and_eager(fn, warmup_ms=10, rep_ms=40)[0]
    for _ in range(3):
        fn()
    runs, spent = [], 0.0
    while len(runs) < 5 or (spent < min_seconds and len(runs) < 200):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
        spent += runs[-1]
    return statistics.median(runs) * 1e6


@torch.no_grad()
def time_linear(key: str, n: int, k: int, m: int, device: str, cpu_mode: str = "runtime") -> float:
    """Median microseconds of y = x @ W^T for x [M, K] through scheme `key`'s runtime method."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer = _runtime_linear(key, n, k, device, dtype, cpu_mode)
    x = torch.randn(m, k, dtype=dtype, device=device)
    return _median_us(lambda: layer(x), device)


def _grouped(key: str, w: torch.Tensor):
    """bf16 experts [E, N, K] -> the fused kernel's GroupedWeight in scheme `key`."""
    from dsquant.formats.awq_gemm import to_awq_tensors
    from dsquant.formats.fp8_block import quantize_fp8_block
    from dsquant.formats.int_grid import quantize_int_groupwise
    from dsquant.runtime.kernels.moe.fused_moe import bf16_experts
    from dsquant.runtime.kernels.moe.fused_moe_fp8 import fp8_experts
    from dsquant.runtime.kernels.moe.fused_moe_int4 import int4_experts_from_awq

    if key == "bf16":
        return bf16_experts(w.contiguous())
    if key.startswith("awq_g"):
        group = int(key[5:])
        parts = [to_awq_tensors(*quantize_int_groupwise(w[e].float(), group), dtype=w.dtype)
                 for e in range(w.shape[0])]
        return int4_experts_from_awq(*[torch.stack([p[i] for p in parts]) for i in range(3)], group)
    if key == "fp8_block":
        parts = [quantize_fp8_block(w[e]) for e in range(w.shape[0])]
        return fp8_experts(torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts]))
    raise DsquantError(f"latency: no fused-MoE timing for scheme {key!r}")


@torch.no_grad()
def time_moe(key_13: str, key_2: str, n_experts: int, top_k: int, inter: int, hidden: int, m: int,
             n_shared: int = 0) -> float:
    """Median CUDA-graph microseconds of one layer's routed experts (fused_moe: alignment, gate/up
    grouped GEMM with SiLU-and-mul, down, top-k sum) for m tokens routed uniformly at random, top_k
    distinct experts each, and n_shared shared experts folded in as the runtime folds them (experts
    n_experts .. n_experts + n_shared - 1, weight 1 for every token). key_13 / key_2: the schemes of
    gate/up and of down (latency-table names). Where the two differ or the quantized grouped GEMM
    refuses the shape, the experts run bf16, as runtime/layers/moe.FusedMoE runs them."""
    from dsquant.runtime.kernels.moe.fused_moe import MoeWeights, bf16_experts, fused_moe, with_shared_experts

    gen = torch.Generator(device="cuda").manual_seed(inter * 31 + hidden)
    total = n_experts + n_shared
    w13 = (torch.randn(total, 2 * inter, hidden, generator=gen, device="cuda") / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(total, hidden, inter, generator=gen, device="cuda") / inter ** 0.5).bfloat16()
    try:
        if key_13 != key_2:
            raise ValueError("gate/up and down in different schemes")
        weights = MoeWeights(_grouped(key_13, w13), _grouped(key_2, w2))
    except ValueError:
        weights = MoeWeights(bf16_experts(w13), bf16_experts(w2))
    x = torch.randn(m, hidden, generator=gen, device="cuda").bfloat16()  # [M, H]
    ids = torch.rand(m, n_experts, generator=gen, device="cuda").argsort(-1)[:, :top_k]  # [M, k] int64, as routing gives
    tw = torch.softmax(torch.randn(m, top_k, generator=gen, device="cuda"), -1)  # [M, k] fp32
    if n_shared:
        tw, ids = with_shared_experts(tw, ids, n_experts, n_shared)  # [M, k + n_shared]
    return _median_us(lambda: fused_moe(x, weights, tw, ids, n_shared=n_shared), "cuda")


@torch.no_grad()
def time_silu_mul(inter: int, m: int) -> float:
    """Median CUDA-graph microseconds of the one silu_mul launch of a GatedMLP of intermediate `inter`
    at m tokens (an unfolded shared-expert MLP's activation: tune/fusion.py)."""
    from dsquant.runtime.kernels.ops.activation import silu_mul

    gate, up = torch.randn(2, m, inter, device="cuda").bfloat16()  # [M, I] each
    return _median_us(lambda: silu_mul(gate, up), "cuda")
