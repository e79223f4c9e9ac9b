"""Quantized-linear method objects: one per weight format, each owning a layer's weights.

A method's life cycle (the vLLM split, style.md):
  create_weights(layer, in_features K, out_features N)   parameters on the meta device, with the
                                                          checkpoint's own names and dtypes
  process_weights_after_loading(layer)                    CUDA: repack into the kernel's layout;
                                                          CPU: cache the dequantized weight
  apply(layer, x [..., K]) -> y [..., N]                  CUDA: the Triton kernel; CPU: torch matmul
  dequantized_weight(layer, dtype) -> [N, K]              the dense weight (tests, absorbed MLA)

Kernel modules are imported inside the CUDA branches only, so the CPU path never touches Triton.
Compressed-tensors methods live in compressed_tensors.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsquant.formats import awq_gemm, fp8_block, gptq


def _meta(shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device="meta"), requires_grad=False)


def method_settings(method) -> tuple:
    """What makes two methods interchangeable: the class and its compared dataclass fields (`source`
    only names the config file). Linears fuse, and experts stack, only when these are equal."""
    if not dataclasses.is_dataclass(method):
        return (type(method),)
    return (type(method),) + tuple((f.name, getattr(method, f.name)) for f in dataclasses.fields(method)
                                   if f.compare and f.name != "source")


class LinearMethod:
    """Base: dense-from-dequant CPU path shared by every scheme."""

    name = "base"
    kernels = True  # False: the pure-torch path on every device (EngineConfig.kernels=False)
    group_size: int | None = None  # INT4 formats: input channels per scale group (-1: one over K)
    dynamic_activations = False  # W8A8 formats: x quantized per token and 128 channels too
    g_idx_name: str | None = None  # INT4 formats: the tensor of each input channel's group, if stored

    def use_kernels(self, t: torch.Tensor) -> bool:
        return self.kernels and t.is_cuda

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int) -> None:
        raise NotImplementedError

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # CPU: dequantize once, in the activation dtype (the dtype of the layer's bias or the model's)
        layer.cpu_weight = self.dequantized_weight(layer, layer.compute_dtype)  # [N, K]

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.cpu_weight.to(x.dtype), layer.bias)

    def release(self, layer: nn.Module, names: tuple[str, ...]) -> None:
        """Drop checkpoint tensors a repacked layout replaced (they would double the memory)."""
        for n in names:
            layer._parameters.pop(n, None)


class DenseMethod(LinearMethod):
    """bf16/fp16/fp32 weight [N, K]: torch.matmul (cuBLAS on CUDA)."""

    name = "dense"

    def create_weights(self, layer, in_features, out_features):
        layer.weight = _meta((out_features, in_features), torch.float32)  # float: cast at load

    def dequantized_weight(self, layer, dtype):
        return layer.weight.to(dtype)

    def process_weights_after_loading(self, layer):
        pass

    def apply(self, layer, x):
        return F.linear(x, layer.weight, layer.bias)


@dataclass
class AWQMethod(LinearMethod):
    """AutoAWQ "gemm": qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales [K/G, N]."""

    group_size: int = 128  # -1: per channel (one group spanning K)
    source: str = "config.json"  # the file the config came from (named in errors)
    name = "awq"

    def create_weights(self, layer, in_features, out_features):
        k, n = in_features, out_features
        g = k if self.group_size <= 0 else self.group_size
        layer.qweight = _meta((k, n // 8), torch.int32)
        layer.qzeros = _meta((k // g, n // 8), torch.int32)
        layer.scales = _meta((k // g, n), torch.float16)  # any float dtype is kept as stored

    def dequantized_weight(self, layer, dtype):
        return awq_gemm.dequantize_awq(layer.qweight, layer.qzeros, layer.scales, self._group(layer), dtype)

    def _group(self, layer) -> int:
        return layer.qweight.shape[0] if self.group_size <= 0 else self.group_size

    def int4_codes(self, layer):
        """-> (codes [N, K] 0..15, zero points [K/G, N], scales [K/G, N] as stored, perm None): W = (q - z) * s."""
        return awq_gemm.unpack_awq(layer.qweight).t(), awq_gemm.unpack_awq(layer.qzeros), layer.scales, None

    def process_weights_after_loading(self, layer):
        if not self.use_kernels(layer.qweight):
            return super().process_weights_after_loading(layer)
        from dsquant.runtime.kernels.gemm.w4a16_repack import repack_awq

        layer.w4 = repack_awq(layer.qweight, layer.qzeros, layer.scales, self._group(layer))
        self.release(layer, ("qweight", "qzeros", "scales"))

    def apply(self, layer, x):
        if not self.use_kernels(x):
            return super().apply(layer, x)
        return _w4a16_apply(layer, x)


def _w4a16_apply(layer, x: torch.Tensor) -> torch.Tensor:
    from dsquant.runtime.kernels.gemm.w4a16_gemm import w4a16_linear

    y = w4a16_linear(x, layer.w4)  # [..., N] in x's dtype
    return y if layer.bias is None else y + layer.bias


@dataclass
class GPTQMethod(LinearMethod):
    """GPTQ v1: qweight int32 [K/8, N], qzeros [K/G, N/8] (z - 1), scales [K/G, N], g_idx [K].

    v2 (checkpoint_format gptq_v2): qzeros hold z itself. Act-order (desc_act) checkpoints
    carry a permuted g_idx (G input channels per group, checked at load); K % G == 0.
    """

    group_size: int = 128  # -1: per channel (one group spanning K)
    v2: bool = False
    source: str = "config.json"  # the file the config came from (named in errors)
    name = "gptq"
    g_idx_name = "g_idx"

    def create_weights(self, layer, in_features, out_features):
        k, n = in_features, out_features
        groups = -(-k // self.group_size) if self.group_size > 0 else 1
        layer.qweight = _meta((k // 8, n), torch.int32)
        layer.qzeros = _meta((groups, n // 8), torch.int32)
        layer.scales = _meta((groups, n), torch.float16)
        layer.g_idx = _meta((k,), torch.int32)

    def dequantized_weight(self, layer, dtype):
        return gptq.dequantize_gptq(layer.qweight, layer.qzeros, layer.scales, layer.g_idx, dtype, v2=self.v2)

    def int4_codes(self, layer):
        """-> (codes [N, K] 0..15, zero points [K/G, N] (v1: 1..16), scales [K/G, N] as stored, perm).
        perm [K] int64 is None unless g_idx is act-order: then the codes' columns are in perm's order
        (column j is input channel perm[j], groups contiguous runs of K) and x[:, perm] meets them;
        a ValueError when its groups are uneven."""
        q = gptq.unpack_gptq_qweight(layer.qweight).t()  # [N, K]
        g_idx = getattr(layer, "g_idx", None)
        perm = None if g_idx is None else gptq.act_order_perm(g_idx, layer.scales.shape[0])
        if perm is not None:
            q = q[:, perm]
        return q, gptq.unpack_gptq_qzeros(layer.qzeros, self.v2), layer.scales, perm

    def process_weights_after_loading(self, layer):
        if not self.use_kernels(layer.qweight):
            return super().process_weights_after_loading(layer)
        from dsquant.runtime.kernels.gemm.w4a16_repack import repack_gptq

        layer.w4 = repack_gptq(layer.qweight, layer.qzeros, layer.scales, layer.g_idx, v2=self.v2)
        self.release(layer, ("qweight", "qzeros", "scales", "g_idx"))

    def apply(self, layer, x):
        if not self.use_kernels(x):
            return super().apply(layer, x)
        return _w4a16_apply(layer, x)


@dataclass
class FP8BlockMethod(LinearMethod):
    """DeepSeek-V3 FP8: weight e4m3 [N, K], weight_scale_inv fp32 [ceil(N/128), ceil(K/128)].

    dynamic_activations (the config's activation_scheme "dynamic", the default): W8A8, x quantized
    per token and 128 channels on every path (the kernels, and the torch path through
    fp8_block.fp8_activation_roundtrip), so CPU, reference and GPU compute the same product;
    False: weight-only, x stays 16-bit.
    """

    block: int = fp8_block.FP8_BLOCK
    dynamic_activations: bool = True
    name = "fp8_block"

    def create_weights(self, layer, in_features, out_features):
        layer.weight = _meta((out_features, in_features), torch.float8_e4m3fn)
        layer.weight_scale_inv = _meta(fp8_block.fp8_block_shape(out_features, in_features, self.block),
                                       torch.float32)

    def dequantized_weight(self, layer, dtype):
        return fp8_block.dequantize_fp8_block(layer.weight, layer.weight_scale_inv, dtype, self.block)

    def fp8_block_tensors(self, layer):
        """-> (weight e4m3 [N, K], scale_inv fp32 [N/128, K/128]) as the checkpoint stores them."""
        return layer.weight, layer.weight_scale_inv

    def process_weights_after_loading(self, layer):
        if not self.use_kernels(layer.weight):
            if self.dynamic_activations:  # fp32, as the W8A8 kernel's exact fp8 products accumulate
                layer.cpu_weight = self.dequantized_weight(layer, torch.float32)  # [N, K]
                return None
            return super().process_weights_after_loading(layer)
        from dsquant.runtime.kernels.gemm.fp8_gemm import cublas_scale_layout
        from dsquant.runtime.kernels.gemm.splitk import new_splitk_counters

        # one layout for every kernel: the Triton ones read the strides, cuBLAS needs the padding
        layer.weight_scale_inv.data = cublas_scale_layout(layer.weight_scale_inv.data.to(torch.float32))
        layer.splitk_counters = new_splitk_counters(layer.weight.device)

    def apply(self, layer, x):
        if not self.use_kernels(x):
            if not self.dynamic_activations:
                return super().apply(layer, x)
            y = F.linear(fp8_block.fp8_activation_roundtrip(x, dtype=torch.float32), layer.cpu_weight)
            return (y if layer.bias is None else y + layer.bias).to(x.dtype)
        from dsquant.runtime.kernels.gemm.fp8_gemm import fp8_block_linear

        y = fp8_block_linear(x, layer.weight, layer.weight_scale_inv,
                             weight_only=None if self.dynamic_activations else True,
                             splitk_counters=getattr(layer, "splitk_counters", None))  # [..., N]
        return y if layer.bias is None else y + layer.bias
