"""A realistic weight (tests/realistic_weights.py) in each checkpoint format, with the float64 dense
weight those tensors encode, rebuilt here from the quantizer's own codes and scales (not through
formats' dequantize_*, which the runtime calls: a bug there must not reach the reference too).

`quantize(fmt, w)` -> QuantizedWeight: tensors as a checkpoint stores them (attribute name ->
tensor, the names QuantLinear's methods read), the dense float64 [N, K], and config.json's
quantization_config for LinearFactory. Formats: "fp8" (DeepSeek-V3 128 x 128 blocks), "awq"
(AutoAWQ gemm), "gptq" (v1, plain g_idx; zero points >= 1, as v1 can store them),
"gptq_act_order" (v1 with a permuted g_idx), "ct_int4" (compressed-tensors pack-quantized, asymmetric,
bf16 scales), "ct_int4_act_order" (the same with actorder "group": weight_g_idx permuted) and "ct_fp8"
(compressed-tensors float-quantized, 128 x 128 blocks, dynamic W8A8).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsquant.formats.awq_gemm import to_awq_tensors
from dsquant.formats.compressed_tensors import pack_quantized_tensors
from dsquant.formats.fp8_block import quantize_fp8_block
from dsquant.formats.gptq import pack_gptq_qweight, to_gptq_tensors
from dsquant.formats.int_grid import quantize_int_groupwise
from tests.realistic_weights import FP8_TILE, realistic_weight

FORMATS = ("fp8", "awq", "gptq", "gptq_act_order", "ct_int4", "ct_int4_act_order", "ct_fp8")
CT_FP8_CONFIG = {  # compressed-tensors W8A8 FP8 block, every Linear
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                    "block_structure": [128, 128]},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
                              "group_size": 128, "dynamic": True}}}}
INT4_TILE_ROWS = 16  # rows per random factor for INT4 weights: group scales differ along N too


@dataclass
class QuantizedWeight:
    tensors: dict[str, torch.Tensor]  # attribute -> tensor, CPU, checkpoint dtypes
    dense: torch.Tensor  # float64 [N, K]: what the tensors encode
    config: dict  # quantization_config


def tile_for(fmt: str, group: int) -> tuple[int, int]:
    """realistic_weight's tile for a format: one factor per FP8 block, or per 16 rows x one group."""
    return FP8_TILE if fmt in ("fp8", "ct_fp8") else (INT4_TILE_ROWS, group)


def realistic_quantized(fmt: str, n: int, k: int, *, seed: int, group: int = 128) -> QuantizedWeight:
    """realistic_weight(n, k) with the tile of `fmt`, quantized in `fmt`."""
    return quantize(fmt, realistic_weight(n, k, seed=seed, tile=tile_for(fmt, group)), group=group, seed=seed)


def quantize(fmt: str, w: torch.Tensor, *, group: int = 128, seed: int = 0) -> QuantizedWeight:
    """w [N, K] float -> its checkpoint tensors in `fmt` and the float64 weight they encode."""
    if fmt in ("fp8", "ct_fp8"):
        q, s = quantize_fp8_block(w)  # [N, K] e4m3, [ceil(N/128), ceil(K/128)] fp32
        n, k = q.shape
        s64 = s.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        if fmt == "ct_fp8":
            return QuantizedWeight({"weight": q, "weight_scale": s}, q.double() * s64, CT_FP8_CONFIG)
        return QuantizedWeight({"weight": q, "weight_scale_inv": s},
                               q.double() * s64,
                               {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    if fmt not in FORMATS:
        raise ValueError(fmt)
    q, s, z = quantize_int_groupwise(w, group)  # codes [N, K], scales / zeros [N, K/G]
    n, k = q.shape
    if fmt.startswith("gptq"):
        # GPTQ v1 stores zero - 1 in 4 bits: a zero point 0 (a group whose minimum is at most a
        # half step below 0, common with outlier channels) would read back as 16. Clamp to >= 1
        # and recompute the codes, as calibrate/gptq.py does
        z = z.clamp(min=1)
        wg = w.float().reshape(n, k // group, group)
        q = (torch.round(wg / s[..., None]) + z[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    s16 = s.bfloat16() if fmt.startswith("ct_int4") else s.half()  # compressed-tensors stores bf16 scales
    g = torch.arange(k) // group
    dense = (q.double() - z.double()[:, g]) * s16.double()[:, g]  # [N, K]
    if fmt.startswith("ct_int4"):
        weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": group}
        tensors = pack_quantized_tensors(q, s16, z)
        if fmt == "ct_int4_act_order":  # actorder "group": stored channel k is channel perm[k], with its group
            perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed + 1))
            tensors = {**pack_quantized_tensors(q[:, perm], s16, z), "weight_g_idx": g[perm].to(torch.int32)}
            dense = dense[:, perm]
            weights["actorder"] = "group"
        return QuantizedWeight(tensors, dense, {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                                "ignore": ["lm_head"],
                                                "config_groups": {"group_0": {"targets": ["Linear"],
                                                                              "weights": weights}}})
    if fmt == "awq":
        qw, qz, sc = to_awq_tensors(q, s, z)
        return QuantizedWeight({"qweight": qw, "qzeros": qz, "scales": sc}, dense,
                               {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
                                "zero_point": True})
    qw, qz, sc, g_idx = to_gptq_tensors(q, s, z, group)
    if fmt == "gptq_act_order":
        # desc_act: input channel k of the stored layer is channel perm[k] of the quantized one,
        # with its code and its group (g_idx no longer sorted)
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed + 1))
        qw = pack_gptq_qweight(q.t()[perm].contiguous())
        g_idx = g_idx[perm]
        dense = dense[:, perm]
    return QuantizedWeight({"qweight": qw, "qzeros": qz, "scales": sc, "g_idx": g_idx}, dense,
                           {"quant_method": "gptq", "bits": 4, "group_size": group,
                            "desc_act": fmt == "gptq_act_order"})
