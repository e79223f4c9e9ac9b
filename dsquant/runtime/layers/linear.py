"""QuantLinear (a Linear whose weights belong to a method object) and the factory that picks the
method per module from the checkpoint's quantization_config (config.json's, or one read from
AutoAWQ's quant_config.json / AutoGPTQ's quantize_config.json: dsquant/quant_config.py).

Schemes read (design.md "Artifact formats"):
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
import re

import torch
from torch import nn

from dsquant.errors import ConfigError
from dsquant.quant_config import int4_spec
from dsquant.runtime.layers.compressed_tensors import ct_method
from dsquant.runtime.layers.quant import AWQMethod, DenseMethod, FP8BlockMethod, GPTQMethod, LinearMethod

log = logging.getLogger(__name__)

# the tensor whose presence in the checkpoint tells that a module is stored in that scheme
_MARKER = {"awq": "qweight", "gptq": "qweight", "fp8_block": "weight_scale_inv",
           "ct_int4": "weight_packed", "ct_fp8": "weight_scale"}


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


def _matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target or name.endswith("." + target)


class LinearFactory:
    """Callable (prefix, in, out, bias) -> QuantLinear, the `Backends.linear` of the runtime."""

    def __init__(self, quantization_config: dict | None, reader=None, kernels: bool = True,
                 source: str | None = None):
        self.q = quantization_config or {}
        self.source = source or "config.json"  # the file the config came from (quant_config.py)
        self.kernels = kernels  # False: every method takes its pure-torch path, on CUDA too
        self.reader = reader  # CheckpointReader or None
        self.method_counts: dict[str, int] = {}
        self.quant_method = self.q.get("quant_method")
        if self.quant_method not in (None, "awq", "gptq", "fp8", "compressed-tensors"):
            raise ConfigError(f"{self.source}: quantization_config.quant_method {self.quant_method!r} is not "
                              "supported (expected awq, gptq, fp8 or compressed-tensors)")
        self.int4 = int4_spec(self.q, self.source) if self.quant_method in ("awq", "gptq") else None
        if self.quant_method == "fp8" and self.q.get("activation_scheme", "dynamic") != "dynamic":
            raise ConfigError(f"config.json: fp8 activation_scheme {self.q.get('activation_scheme')!r} is not "
                              "supported (expected dynamic)")
        if self.quant_method == "fp8" and list(self.q.get("weight_block_size") or [128, 128]) != [128, 128]:
            raise ConfigError(f"config.json: fp8 weight_block_size {self.q.get('weight_block_size')} is not "
                              "supported (expected [128, 128])")

    def _not_converted(self, prefix: str) -> bool:
        skip = (self.q.get("modules_to_not_convert") or []) + (self.q.get("ignored_layers") or [])
        return any(s and (s in prefix) for s in skip)

    def scheme_for(self, prefix: str) -> LinearMethod:
        """The method the config assigns to module `prefix` (before any checkpoint check)."""
        qm = self.quant_method
        if qm is None:
            return DenseMethod()
        if qm == "compressed-tensors":
            if any(_matches(prefix, t) for t in self.q.get("ignore") or []):
                return DenseMethod()
            for group in (self.q.get("config_groups") or {}).values():
                targets = group.get("targets") or []
                hit = any(_matches(prefix, t) for t in targets if t != "Linear")
                if hit or ("Linear" in targets and prefix != "lm_head"):
                    return ct_method(group.get("weights") or {}, group.get("format") or self.q.get("format"),
                                     group.get("input_activations"))
            return DenseMethod()
        if prefix == "lm_head" or self._not_converted(prefix):
            return DenseMethod()
        spec = self.int4
        if qm == "awq":
            return AWQMethod(group_size=spec.group_size, source=spec.source)
        if qm == "gptq":
            return GPTQMethod(group_size=spec.group_size, v2=spec.v2, source=spec.source)
        return FP8BlockMethod()

    def __call__(self, prefix: str, in_features: int, out_features: int, bias: bool) -> QuantLinear:
        method = self.scheme_for(prefix)
        if self.reader is not None and method.name != "dense":
            marker = f"{prefix}.{_MARKER[method.name]}"
            if marker not in self.reader and f"{prefix}.weight" in self.reader:
                log.debug("%s: %s not in the checkpoint, loading it dense", prefix, marker)
                method = DenseMethod()
        if prefix.endswith("kv_b_proj") and getattr(method, "dynamic_activations", False):
            # MLA's kernel path absorbs kv_b_proj (W_UK, W_UV dequantized), so its input is never
            # quantized there: FP8 weight-only on every path, so all paths compute one product
            method.dynamic_activations = False
        method.kernels = self.kernels
        self.method_counts[method.name] = self.method_counts.get(method.name, 0) + 1
        return QuantLinear(method, prefix, in_features, out_features, bias)
