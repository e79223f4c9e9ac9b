"""compressed-tensors (llm-compressor) methods: pack-quantized INT4 and float-quantized FP8.

Layouts, the config groups and their validation: formats/compressed_tensors.py. Method selection
(targets, ignore) is the parsed config's `scheme_for`; linear.py builds the method.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsquant.formats import fp8_block, gptq
from dsquant.formats.compressed_tensors import CTFp8Scheme, CTGroup, CTInt4Scheme, unpack_int4_rows
from dsquant.runtime.layers.quant import LinearMethod, _meta, _w4a16_apply


@dataclass
class CTPackedInt4Method(LinearMethod):
    """compressed-tensors pack-quantized 4-bit weights, group (or channel) strategy."""

    group_size: int = 128  # 0 or -1: channel strategy (one group spanning K)
    symmetric: bool = False
    g_idx: bool = False  # actorder "group": weight_g_idx [K] int32, each input channel's group
    name = "ct_int4"

    @property
    def g_idx_name(self) -> str | None:
        return "weight_g_idx" if self.g_idx else None

    def _groups(self, k: int) -> int:
        return 1 if self.group_size <= 0 else -(-k // self.group_size)

    def create_weights(self, layer, in_features, out_features):
        n, k, g = out_features, in_features, self._groups(in_features)
        layer.weight_packed = _meta((n, k // 8), torch.int32)
        layer.weight_scale = _meta((n, g), torch.bfloat16)
        if not self.symmetric:
            layer.weight_zero_point = _meta((n // 8, g), torch.int32)
        layer.weight_shape = _meta((2,), torch.int64)
        if self.g_idx:
            layer.weight_g_idx = _meta((k,), torch.int32)

    def _channel_groups(self, layer, k: int, device) -> torch.Tensor:
        """[K] int64: the group of each input channel (weight_g_idx under actorder "group")."""
        if self.g_idx:
            return layer.weight_g_idx.to(device=device, dtype=torch.long)
        gs = k if self.group_size <= 0 else self.group_size
        return torch.arange(k, device=device) // gs

    def _perm(self, layer):
        """The act-order channel order (gptq.act_order_perm of weight_g_idx), or None."""
        if not self.g_idx:
            return None
        return gptq.act_order_perm(layer.weight_g_idx, layer.weight_scale.shape[1])

    def _codes(self, layer):
        """-> (q [N, K] unsigned codes, z [N, G] unsigned zero points, s [N, G] fp32)."""
        n, k = layer.weight_packed.shape[0], layer.weight_packed.shape[1] * 8
        q = unpack_int4_rows(layer.weight_packed)  # [N, K]
        s = layer.weight_scale.to(torch.float32)  # [N, G]
        if self.symmetric:
            z = torch.full_like(s, 8, dtype=torch.int32)
        else:
            z = unpack_int4_rows(layer.weight_zero_point.t().contiguous()).t()[:n]  # [N, G]
        return q[:, :k], z, s

    def int4_codes(self, layer):
        """-> (codes [N, K] 0..15, zero points [K/G, N], scales [K/G, N] in the stored dtype, perm): perm
        as GPTQMethod.int4_codes gives it (None unless actorder "group" scatters the groups over K)."""
        q, z, s = self._codes(layer)
        perm = self._perm(layer)
        if perm is not None:
            q = q[:, perm]
        return q, z.t(), s.t().to(layer.weight_scale.dtype), perm

    def dequantized_weight(self, layer, dtype):
        q, z, s = self._codes(layer)
        g = self._channel_groups(layer, q.shape[1], q.device)  # [K]
        return ((q - z[:, g]).to(torch.float32) * s[:, g]).to(dtype)  # [N, K]

    def process_weights_after_loading(self, layer):
        if not self.use_kernels(layer.weight_packed):
            return super().process_weights_after_loading(layer)
        from dsquant.runtime.kernels.gemm.w4a16_repack import kernel_weights

        q, z, s, perm = self.int4_codes(layer)  # [N, K] (act-order: columns by group), [K/G, N] x 2, [K]
        k = q.shape[1]
        gs = k if self.group_size <= 0 else self.group_size
        layer.w4 = kernel_weights(q.t(), z, s, gs, None if perm is None else perm.to(torch.int32).contiguous())
        self.release(layer, ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx"))

    def apply(self, layer, x):
        if not self.use_kernels(x):
            return super().apply(layer, x)
        return _w4a16_apply(layer, x)


@dataclass
class CTFloat8Method(LinearMethod):
    """compressed-tensors float-quantized FP8 weights (block, channel or tensor scales)."""

    strategy: str = "block"  # "block" | "channel" | "tensor"
    block: int = fp8_block.FP8_BLOCK
    dynamic_activations: bool = False  # W8A8 as FP8BlockMethod when the group quantizes inputs
    name = "ct_fp8"

    def create_weights(self, layer, in_features, out_features):
        n, k = out_features, in_features
        layer.weight = _meta((n, k), torch.float8_e4m3fn)
        shape = {"block": fp8_block.fp8_block_shape(n, k, self.block), "channel": (n, 1), "tensor": (1,)}
        layer.weight_scale = _meta(shape[self.strategy], torch.float32)

    def dequantized_weight(self, layer, dtype):
        if self.strategy == "block":
            return fp8_block.dequantize_fp8_block(layer.weight, layer.weight_scale, dtype, self.block)
        scale = layer.weight_scale.to(torch.float32).reshape(-1, 1)  # [N or 1, 1]
        return (layer.weight.to(torch.float32) * scale).to(dtype)

    def fp8_block_tensors(self, layer):
        """-> (weight e4m3 [N, K], scale fp32 [N/128, K/128]); a ValueError for channel or tensor scales."""
        if self.strategy != "block" or self.block != fp8_block.FP8_BLOCK:
            raise ValueError(f"FP8 {self.strategy} scales (the grouped FP8 GEMM takes 128 x 128 blocks)")
        return layer.weight, layer.weight_scale

    def process_weights_after_loading(self, layer):
        if not self.use_kernels(layer.weight):
            return super().process_weights_after_loading(layer)
        from dsquant.runtime.kernels.gemm.splitk import new_splitk_counters

        n, k = layer.weight.shape
        layer.splitk_counters = new_splitk_counters(layer.weight.device)
        if self.strategy == "block":
            from dsquant.runtime.kernels.gemm.fp8_gemm import cublas_scale_layout

            layer.scale_inv = cublas_scale_layout(layer.weight_scale.to(torch.float32).contiguous())
            layer.out_scale = None
        else:
            # per-row scales commute with the GEMM: y = (x @ weight^T) * scale[n]
            layer.scale_inv = torch.ones(fp8_block.fp8_block_shape(n, k), dtype=torch.float32, device="cuda")
            layer.out_scale = layer.weight_scale.to(torch.float32).reshape(-1)  # [N] or [1]

    def apply(self, layer, x):
        if not self.use_kernels(x):
            return super().apply(layer, fp8_block.fp8_activation_roundtrip(x) if self.dynamic_activations else x)
        from dsquant.runtime.kernels.gemm.fp8_gemm import fp8_block_linear

        y = fp8_block_linear(x, layer.weight, layer.scale_inv,
                             weight_only=None if self.dynamic_activations else True,
                             splitk_counters=layer.splitk_counters)
        if layer.out_scale is not None:
            y = (y.float() * layer.out_scale).to(x.dtype)
        return y if layer.bias is None else y + layer.bias


# a group's parsed scheme -> its method object
CT_METHODS = {
    CTInt4Scheme: lambda s: CTPackedInt4Method(group_size=s.group_size, symmetric=s.symmetric, g_idx=s.g_idx),
    CTFp8Scheme: lambda s: CTFloat8Method(strategy=s.strategy, dynamic_activations=s.dynamic_activations),
}


def ct_method(weights: dict, fmt: str | None, input_activations: dict | None = None) -> LinearMethod:
    """The method for one config group's `weights` args (and the group's or config's format),
    validated by formats.compressed_tensors.CTGroup.scheme."""
    scheme = CTGroup((), weights, input_activations, fmt).scheme()
    return CT_METHODS[type(scheme)](scheme)
