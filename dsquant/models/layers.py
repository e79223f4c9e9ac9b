"""Building blocks shared by every family: the pluggable parts (`Backends`), RMSNorm, SwiGLU MLP.

Linear layers are created through `Backends.linear(prefix, in_features, out_features, bias)`,
where `prefix` is the module's full name in the checkpoint ("model.layers.3.mlp.down_proj").
The default makes `nn.Linear`; the runtime passes a factory that returns quantized linears
(AWQ, GPTQ, FP8 block) whose parameters carry the checkpoint's own tensor names, so loading
stays a name-for-name copy. The module classes the model constructs (norms, MLPs, router, MoE
block, MLA attention, decoder layer) also come from `Backends`, so the runtime's kernel-path
subclasses (runtime/layers/fused.py) are built in place of the plain ones, never swapped in later;
and under tensor parallelism `all_reduce` / `gather_logits` combine the ranks' partial results.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

LinearFactory = Callable[[str, int, int, bool], nn.Module]


def dense_linear(prefix: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
    """The reference linear: a plain nn.Linear (weights come from the checkpoint)."""
    return nn.Linear(in_features, out_features, bias=bias, device="meta")


def meta_embedding(vocab_size: int, hidden_size: int) -> nn.Module:
    """The token embedding, weight [vocab, hidden] on meta. Given its weight, Embedding skips
    reset_parameters: a normal_ on meta imports torch._dynamo (3 s)."""
    return nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size, device="meta"))


def unchanged(x: torch.Tensor) -> torch.Tensor:
    """One process holds the whole model: its partial sums and logits are already complete."""
    return x


class AttentionBackend(Protocol):
    """Computes attention once projections and RoPE are done (see models/attention.py)."""

    # None, or the whole MLA attention from the projections' raw outputs in fewer launches:
    # mla_fused(module, q [B, T, H, nope + rope], latent [B, T, R + rope], ctx) -> [B, T, H, v]
    # (runtime/layers/attention_triton.py; the kernel-path MLA module calls it when set)
    mla_fused: Callable[..., torch.Tensor] | None

    def gqa(self, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            ctx: object) -> torch.Tensor: ...

    def mla(self, module: nn.Module, q_nope: torch.Tensor, q_pe: torch.Tensor,
            kv_latent: torch.Tensor, k_pe: torch.Tensor, ctx: object) -> torch.Tensor: ...

    def prepare(self, decoder_layer: nn.Module) -> None:
        """Right after a layer's tensors load, before its linears repack (e.g. take MLA's absorbed
        weights); the references do nothing."""


class PagedAttentionBackend(AttentionBackend, Protocol):
    """An attention backend over the engine's paged KV cache (runtime/layers/attention.py)."""

    def bind(self, model: nn.Module, kv_caches: list[tuple], spec: object = None) -> None:
        """Attend over kv_caches (one tuple of tensors per decoder layer, laid out for `spec`)."""


class MoEBackend(Protocol):
    """Runs the routed experts for already-routed tokens (see models/moe.py)."""

    def experts(self, module: nn.Module, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor: ...

    def runs_shared_experts(self, module: nn.Module) -> bool:
        """Whether `experts` also ran module's shared experts (MoE.forward then skips them)."""

    def prepare(self, decoder_layer: nn.Module) -> None:
        """Right after a layer's tensors load, before its linears repack (e.g. stack the experts)."""


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


@dataclass
class Backends:
    """The pluggable parts of a model; defaults are the pure-torch reference implementations.

    A `*_cls` field is the class the model constructs there (None: the plain class named beside
    it, which lives in a module that imports this one); the runtime passes its subclasses."""

    linear: LinearFactory = dense_linear
    attention: AttentionBackend | None = None  # None: models.attention.EagerAttention()
    moe: MoEBackend | None = None  # None: models.moe.LoopMoE()
    norm_cls: type[RMSNorm] = RMSNorm  # every RMSNorm (layer norms, final norm, MLA's q_a / kv_a norms)
    mlp_cls: type[GatedMLP] = GatedMLP  # dense MLPs, routed and shared experts
    router_cls: type[nn.Module] | None = None  # None: models.moe.Router
    moe_cls: type[nn.Module] | None = None  # None: models.moe.MoE
    mla_cls: type[nn.Module] | None = None  # None: models.attention.MLAttention
    decoder_layer_cls: type[nn.Module] | None = None  # None: models.causal_lm.DecoderLayer
    # Tensor parallelism builds each rank's shard directly (runtime/parallel/model.py): `local(n)` is
    # this process's range of n attention heads, GQA kv heads or routed experts (the model builds
    # only those); `linear` is then given the checkpoint's full shapes and returns this rank's
    # shard, and `embedding(vocab, hidden)` this rank's rows. One process: everything.
    local: Callable[[int], range] = range
    embedding: Callable[[int, int], nn.Module] = meta_embedding
    # attention / MLP outputs [..., hidden] -> their sum over tensor-parallel ranks (in place)
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = unchanged
    # lm_head's output [..., vocab part] -> the whole vocabulary's logits (rank 0 under tensor parallelism)
    gather_logits: Callable[[torch.Tensor], torch.Tensor] = unchanged
