"""Building blocks shared by every family: the pluggable linear factory, RMSNorm, SwiGLU MLP.

Linear layers are created through `Backends.linear(prefix, in_features, out_features, bias)`,
where `prefix` is the module's full name in the checkpoint ("model.layers.3.mlp.down_proj").
The default makes `nn.Linear`; the runtime passes a factory that returns quantized linears
(AWQ, GPTQ, FP8 block) whose parameters carry the checkpoint's own tensor names, so loading
stays a name-for-name copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

LinearFactory = Callable[[str, int, int, bool], nn.Module]


def dense_linear(prefix: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
    """The reference linear: a plain nn.Linear (weights come from the checkpoint)."""
    return nn.Linear(in_features, out_features, bias=bias, device="meta")


class AttentionBackend(Protocol):
    """Computes attention once projections and RoPE are done (see models/attention.py)."""

    def gqa(self, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            ctx: object) -> torch.Tensor: ...

    def mla(self, module: nn.Module, q_nope: torch.Tensor, q_pe: torch.Tensor,
            kv_latent: torch.Tensor, k_pe: torch.Tensor, ctx: object) -> torch.Tensor: ...


class MoEBackend(Protocol):
    """Runs the routed experts for already-routed tokens (see models/moe.py)."""

    def experts(self, module: nn.Module, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor: ...


@dataclass
class Backends:
    """The pluggable parts of a model; defaults are the pure-torch reference implementations."""

    linear: LinearFactory = dense_linear
    attention: AttentionBackend | None = None  # None: models.attention.EagerAttention()
    moe: MoEBackend | None = None  # None: models.moe.LoopMoE()
    extra: dict = field(default_factory=dict)


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back (as transformers does)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device="meta"))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Used for dense MLPs, experts and shared experts."""

    def __init__(self, prefix: str, hidden: int, intermediate: int, backends: Backends,
                 bias: bool = False):
        super().__init__()
        self.gate_proj = backends.linear(f"{prefix}.gate_proj", hidden, intermediate, bias)
        self.up_proj = backends.linear(f"{prefix}.up_proj", hidden, intermediate, bias)
        self.down_proj = backends.linear(f"{prefix}.down_proj", intermediate, hidden, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
