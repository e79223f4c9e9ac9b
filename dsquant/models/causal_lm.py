"""One decoder-only causal LM for all four families (DeepSeek V2/V3, Llama, Qwen2).

The families differ only in the attention module (MLA or GQA) and the MLP (MoE or dense), so
one `CausalLM` builds either from the config; module names match the checkpoints' tensor names
("model.layers.{i}.self_attn.q_a_proj.weight"), so loading copies tensors by name. Modules are
created on the meta device; the loader materialises them on the target device from the
checkpoint, one decoder layer at a time if asked. Which classes are built (the plain ones, or the
runtime's kernel-path subclasses) and how tensor-parallel ranks combine their partial sums is
decided by `Backends` (models/layers.py) at construction.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dsquant.config import ModelConfig
from dsquant.models.attention import EagerAttention, EagerContext, GQAAttention, MLAttention
from dsquant.models.layers import Backends
from dsquant.models.moe import MoE, LoopMoE
from dsquant.models.rope import inv_freq_and_attention_factor


def rank_config(cfg: ModelConfig, local) -> ModelConfig:
    """cfg as this process sees it (what sizes its KV cache): its attention heads, and GQA's kv
    heads (head_dim pinned); cfg itself when the process holds every head."""
    heads = len(local(cfg.num_attention_heads))
    if heads == cfg.num_attention_heads:
        return cfg
    view = dict(num_attention_heads=heads)
    if not cfg.is_deepseek:
        view.update(num_key_value_heads=len(local(cfg.num_key_value_heads)), head_dim=cfg.dense_head_dim)
    return dataclasses.replace(cfg, **view)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h)). `all_reduce` sums the attention
    and MLP outputs over tensor-parallel ranks (each holds a partial sum); one process: unchanged."""

    def __init__(self, cfg: ModelConfig, idx: int, backends: Backends):
        super().__init__()
        prefix = f"model.layers.{idx}"
        self.layer_idx = idx
        attn_backend = backends.attention or EagerAttention()
        attn_cls = (backends.mla_cls or MLAttention) if cfg.is_deepseek else GQAAttention
        self.self_attn = attn_cls(cfg, f"{prefix}.self_attn", backends, attn_backend)
        self.input_layernorm = backends.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = backends.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(idx):
            self.mlp = (backends.moe_cls or MoE)(cfg, f"{prefix}.mlp", backends, backends.moe or LoopMoE())
        else:
            self.mlp = backends.mlp_cls(f"{prefix}.mlp", cfg.hidden_size, cfg.intermediate_size, backends)
        self.all_reduce = backends.all_reduce

    def forward(self, hidden: torch.Tensor, ctx) -> torch.Tensor:
        # hidden [B, T, hidden_size]
        hidden = hidden + self.all_reduce(self.self_attn(self.input_layernorm(hidden), ctx))
        return hidden + self.all_reduce(self.mlp(self.post_attention_layernorm(hidden)))


class DecoderStack(nn.Module):
    """`model.*` in the checkpoint: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: ModelConfig, backends: Backends):
        super().__init__()
        self.embed_tokens = backends.embedding(cfg.vocab_size, cfg.hidden_size)
        layer_cls = backends.decoder_layer_cls or DecoderLayer
        self.layers = nn.ModuleList(layer_cls(cfg, i, backends) for i in range(cfg.num_hidden_layers))
        self.norm = backends.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """forward(input_ids [B, T]) -> logits [B, T, vocab]; reference path unless backends say else."""

    def __init__(self, cfg: ModelConfig, backends: Backends | None = None):
        super().__init__()
        self.backends = backends or Backends()
        self.config = rank_config(cfg, self.backends.local)
        self.model = DecoderStack(cfg, self.backends)
        self.lm_head = self.backends.linear("lm_head", cfg.hidden_size, cfg.vocab_size, False)
        rot = cfg.qk_rope_head_dim if cfg.is_deepseek else cfg.dense_head_dim
        inv_freq, self.rope_attention_factor = inv_freq_and_attention_factor(cfg.rope, rot)
        self.inv_freq = inv_freq  # [rot/2] fp32; a plain attribute, so meta/to_empty leave it alone

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] int -> cos, sin [..., rot/2] fp32, attention factor included."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        return freqs.cos() * self.rope_attention_factor, freqs.sin() * self.rope_attention_factor

    def eager_context(self, positions: torch.Tensor, attention_mask: torch.Tensor | None = None):
        cos, sin = self.rope_cos_sin(positions)
        return EagerContext(cos=cos, sin=sin, attention_mask=attention_mask)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # tensor parallel: lm_head gives this rank's part of the vocabulary; gathered to rank 0
        return self.backends.gather_logits(self.lm_head(self.model.norm(hidden)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, ctx=None) -> torch.Tensor:
        # input_ids [B, T]; positions [B, T] (default 0..T-1); attention_mask [B, T] (1 = token)
        return self.logits(self.hidden_states(input_ids, positions, attention_mask, ctx))  # [B, T, V]

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None, ctx=None) -> torch.Tensor:
        """The last decoder layer's output [B, T, H], before the final norm and lm_head (`logits`
        applies both): callers that need a few positions' logits at a time skip the [B, T, V] tensor."""
        if positions is None:
            t = input_ids.shape[-1]
            positions = torch.arange(t, device=input_ids.device).expand(input_ids.shape)
        if ctx is None:
            ctx = self.eager_context(positions, attention_mask)
        hidden = self.embed(input_ids)
        for layer in self.model.layers:
            hidden = layer(hidden, ctx)
        return hidden
