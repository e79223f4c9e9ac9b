"""QuantLinear (a Linear whose weights belong to a method object) and the factory that picks the
method per module: it parses the checkpoint's quantization_config once (config.json's, or one read
from AutoAWQ's quant_config.json / AutoGPTQ's quantize_config.json:
formats.parse_quantization_config), asks the parsed config for each module's scheme
(`scheme_for`: the format and its arguments, or None for dense) and builds that scheme's method.

Schemes read (design.md "Artifact formats"; the rules live in dsquant/formats/):
  none                  every Linear dense
  awq                   AutoAWQ gemm; `modules_to_not_convert` (substrings of the module name) dense
  gptq                  GPTQ v1, or v2 (checkpoint_format gptq_v2); desc_act via g_idx;
                        `modules_to_not_convert` dense
  fp8                   DeepSeek-V3 block FP8; modules without `weight_scale_inv` in the checkpoint
                        are dense (the native V3 checkpoint keeps lm_head, gate and norms in bf16)
  compressed-tensors    `config_groups` targets ("Linear", "re:<regex>", or names) and `ignore`
lm_head stays dense for every scheme unless a compressed-tensors group targets it by name.
Whenever the checkpoint is known, a module whose expected tensors are absent but whose dense
`weight` is present loads dense (so kept layers need not be listed exactly).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from dsquant.formats import AwqConfig, Fp8BlockConfig, GptqConfig, parse_quantization_config
from dsquant.runtime.layers.compressed_tensors import CT_METHODS
from dsquant.runtime.layers.quant import AWQMethod, DenseMethod, FP8BlockMethod, GPTQMethod, LinearMethod

log = logging.getLogger(__name__)

# a module's parsed scheme (formats/) -> its method object
_METHODS = {
    AwqConfig: lambda s: AWQMethod(group_size=s.group_size, source=s.source),
    GptqConfig: lambda s: GPTQMethod(group_size=s.group_size, v2=s.v2, source=s.source),
    Fp8BlockConfig: lambda s: FP8BlockMethod(),
    **CT_METHODS,
}


def method_for(scheme) -> LinearMethod:
    """The method object of a parsed scheme (None: dense)."""
    return DenseMethod() if scheme is None else _METHODS[type(scheme)](scheme)


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias), W held by `method` in whatever format it loads."""

    def __init__(self, method: LinearMethod, prefix: str, in_features: int, out_features: int,
                 bias: bool):
        super().__init__()
        self.method, self.prefix = method, prefix
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype = torch.bfloat16  # set by the loader to the model's dtype
        method.create_weights(self, in_features, out_features)
        self.bias = nn.Parameter(torch.empty(out_features, device="meta"), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def extra_repr(self) -> str:
        return f"{self.prefix}: {self.in_features} -> {self.out_features}, {self.method.name}"


class LinearFactory:
    """Callable (prefix, in, out, bias) -> QuantLinear, the `Backends.linear` of the runtime."""

    def __init__(self, quantization_config: dict | None, reader=None, kernels: bool = True,
                 source: str | None = None):
        self.source = source or "config.json"  # the file the config came from (formats/quantization_config.py)
        self.format = parse_quantization_config(quantization_config, self.source)  # None: dense
        self.kernels = kernels  # False: every method takes its pure-torch path, on CUDA too
        self.reader = reader  # CheckpointReader or None
        self.method_counts: dict[str, int] = {}

    def _scheme(self, prefix: str):
        return None if self.format is None else self.format.scheme_for(prefix)

    def scheme_for(self, prefix: str) -> LinearMethod:
        """The method the config assigns to module `prefix` (before any checkpoint check)."""
        return method_for(self._scheme(prefix))

    def __call__(self, prefix: str, in_features: int, out_features: int, bias: bool) -> QuantLinear:
        scheme = self._scheme(prefix)
        method = method_for(scheme)
        if self.reader is not None and scheme is not None:
            marker = f"{prefix}.{scheme.marker}"
            if marker not in self.reader and f"{prefix}.weight" in self.reader:
                log.debug("%s: %s not in the checkpoint, loading it dense", prefix, marker)
                method = DenseMethod()
        if prefix.endswith("kv_b_proj") and method.dynamic_activations:
            # MLA's kernel path absorbs kv_b_proj (W_UK, W_UV dequantized), so its input is never
            # quantized there: FP8 weight-only on every path, so all paths compute one product
            method.dynamic_activations = False
        method.kernels = self.kernels
        self.method_counts[method.name] = self.method_counts.get(method.name, 0) + 1
        return QuantLinear(method, prefix, in_features, out_features, bias)
