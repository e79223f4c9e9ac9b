"""Attention modules: GQA (Llama, Qwen2) and MLA (DeepSeek V2/V3), with a pluggable backend.

Each module does its projections and RoPE, then hands q/k/v (GQA) or the MLA pieces to
`backend.gqa(...)` / `backend.mla(...)`, which own the score computation and any KV cache.
`EagerAttention` is the reference backend: causal attention over a [B, T] batch, no cache.
A paged backend (runtime) stores k/v, or MLA's latent + rope key, and may use the absorbed form.

MLA (DeepSeek-V2 paper, arXiv 2405.04434): per token the cache holds c_kv = norm(W_DKV x)
[kv_lora_rank] and one rope key k_pe [qk_rope_head_dim] shared by all heads; kv_b_proj
(W_UK; W_UV stacked per head) expands c_kv into per-head k_nope [qk_nope_head_dim] and
v [v_head_dim].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsquant.config import ModelConfig
from dsquant.models.layers import Backends
from dsquant.models.rope import apply_rope, softmax_scale_factor


@dataclass
class EagerContext:
    """Reference-path context: cos/sin for the batch's positions and an optional padding mask."""

    cos: torch.Tensor  # [B, T, rot/2] fp32
    sin: torch.Tensor  # [B, T, rot/2] fp32
    attention_mask: torch.Tensor | None = None  # [B, T] bool, True = real token


def _causal_mask(ctx: EagerContext, t: int, device) -> torch.Tensor | None:
    if ctx.attention_mask is None:
        return None
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()  # [T, T]
    keys = ctx.attention_mask[:, None, None, :].to(torch.bool)  # [B, 1, 1, T]
    mask = causal[None, None] & keys  # [B, 1, T, T]
    # a fully masked row (a padding query) would softmax to NaN: let it see itself
    return mask | torch.eye(t, dtype=torch.bool, device=device)[None, None]


class EagerAttention:
    """Pure-torch causal attention over a padded batch (the oracle path)."""

    mla_fused = None  # no fused MLA path (models.layers.AttentionBackend)

    def prepare(self, decoder_layer) -> None:
        pass

    def gqa(self, module, q, k, v, ctx: EagerContext):
        # q [B, T, Hq, D]; k, v [B, T, Hkv, D] -> [B, T, Hq, D]
        mask = _causal_mask(ctx, q.shape[1], q.device)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            is_causal=mask is None, scale=module.scaling,
            enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)

    def mla(self, module, q_nope, q_pe, kv_latent, k_pe, ctx: EagerContext):
        # q_nope [B, T, H, nope]; q_pe [B, T, H, rope]; kv_latent [B, T, R]; k_pe [B, T, rope]
        b, t, h, _ = q_nope.shape
        kv = module.kv_b_proj(kv_latent).view(b, t, h, module.qk_nope_head_dim + module.v_head_dim)
        k_nope, v = kv.split([module.qk_nope_head_dim, module.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, :, None, :].expand(b, t, h, k_pe.shape[-1])], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        mask = _causal_mask(ctx, t, q.device)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            is_causal=mask is None, scale=module.scaling)
        return out.transpose(1, 2)  # [B, T, H, v_head_dim]


class GQAAttention(nn.Module):
    """Llama / Qwen2 attention: q/k/v projections (bias on Qwen2), neox RoPE, o_proj."""

    def __init__(self, cfg: ModelConfig, prefix: str, backends: Backends, backend):
        super().__init__()
        d, h, h_kv = cfg.dense_head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        # this process's heads (all of them, but one rank's under tensor parallelism)
        self.num_heads, self.num_kv_heads, self.head_dim = len(backends.local(h)), len(backends.local(h_kv)), d
        self.scaling = d ** -0.5
        bias = cfg.attention_bias
        # the checkpoint's shapes; backends.linear returns this rank's shard of each
        self.q_proj = backends.linear(f"{prefix}.q_proj", cfg.hidden_size, h * d, bias)
        self.k_proj = backends.linear(f"{prefix}.k_proj", cfg.hidden_size, h_kv * d, bias)
        self.v_proj = backends.linear(f"{prefix}.v_proj", cfg.hidden_size, h_kv * d, bias)
        self.o_proj = backends.linear(f"{prefix}.o_proj", h * d, cfg.hidden_size, False)
        self.backend = backend

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        b, t, _ = x.shape  # x [B, T, hidden]
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, ctx.cos, ctx.sin, interleaved=False)
        k = apply_rope(k, ctx.cos, ctx.sin, interleaved=False)
        out = self.backend.gqa(self, q, k, v, ctx)  # [B, T, Hq, D]
        return self.o_proj(out.reshape(b, t, -1))


class MLAttention(nn.Module):
    """DeepSeek multi-head latent attention, with or without q LoRA, YaRN mscale in `scaling`."""

    def __init__(self, cfg: ModelConfig, prefix: str, backends: Backends, backend):
        super().__init__()
        self.num_heads = len(backends.local(cfg.num_attention_heads))  # this process's heads
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.rope_interleave = cfg.rope_interleave
        self.scaling = cfg.qk_head_dim ** -0.5 * softmax_scale_factor(cfg.rope)
        hid, h, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias  # checkpoint shapes
        if self.q_lora_rank is None:
            self.q_proj = backends.linear(f"{prefix}.q_proj", hid, h * cfg.qk_head_dim, False)
        else:
            self.q_a_proj = backends.linear(f"{prefix}.q_a_proj", hid, self.q_lora_rank, bias)
            self.q_a_layernorm = backends.norm_cls(self.q_lora_rank, 1e-6)
            self.q_b_proj = backends.linear(f"{prefix}.q_b_proj", self.q_lora_rank, h * cfg.qk_head_dim, False)
        self.kv_a_proj_with_mqa = backends.linear(
            f"{prefix}.kv_a_proj_with_mqa", hid, self.kv_lora_rank + self.qk_rope_head_dim, bias)
        self.kv_a_layernorm = backends.norm_cls(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = backends.linear(
            f"{prefix}.kv_b_proj", self.kv_lora_rank, h * (self.qk_nope_head_dim + self.v_head_dim), False)
        self.o_proj = backends.linear(f"{prefix}.o_proj", h * self.v_head_dim, hid, bias)
        self.backend = backend

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        b, t, _ = x.shape  # x [B, T, hidden]
        q, latent = self.project(x)
        q = q.view(b, t, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        out = self.attend(q, latent, ctx)  # [B, T, H, v]
        return self.o_proj(out.reshape(b, t, -1))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> (q [B, T, H * (nope + rope)], latent [B, T, R + rope]); the runtime
        fuses the two input projections into one GEMM."""
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q, self.kv_a_proj_with_mqa(x)

    def attend(self, q: torch.Tensor, latent: torch.Tensor, ctx) -> torch.Tensor:
        """q [B, T, H, nope + rope] and latent [B, T, R + rope] (the projections' outputs) -> [B, T, H, v]:
        the kv_a RMSNorm, rope and the backend's attention (the runtime fuses these steps)."""
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_latent, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_latent = self.kv_a_layernorm(kv_latent)  # [B, T, R]
        q_pe, k_pe = self.rotate(q_pe, k_pe, ctx)
        return self.backend.mla(self, q_nope, q_pe, kv_latent, k_pe, ctx)  # [B, T, H, v]

    def rotate(self, q_pe: torch.Tensor, k_pe: torch.Tensor, ctx):
        """RoPE on q_pe [B, T, H, rope] and k_pe [B, T, rope] (the runtime fuses this step)."""
        q_pe = apply_rope(q_pe, ctx.cos, ctx.sin, self.rope_interleave)  # [B, T, H, rope]
        k_pe = apply_rope(k_pe[:, :, None, :], ctx.cos, ctx.sin, self.rope_interleave)[:, :, 0]
        return q_pe, k_pe
