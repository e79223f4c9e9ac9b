"""Paged attention for the runtime: the per-step context and the pure-torch (CPU) backend.

The model runs the flattened batch as B=1, T=num_tokens; sequence b owns rows
cu_seqlens_q[b]:cu_seqlens_q[b+1] of the T new tokens and has seq_lens[b] tokens in the cache
once they are written (its cached context plus the new ones). Query i of sequence b sits at
position seq_lens[b] - q_len_b + i and attends causally to cache positions 0 .. that position.

Cache layouts (one entry per decoder layer, shared with the Triton kernels): kv_cache.py, for
the model dtype and for FP8 (--kv-cache-dtype fp8: each token is quantized when stored, through
kernels/attention/kv_fp8_layout.py, and dequantized when read, so every key a query sees, its own included,
has been through the cache). slot_mapping[t] = block * block_size + offset of new token t.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dsquant.runtime.kernels.attention.kv_fp8_layout import (dequantize_fp8, dequantize_mla_fp8, quantize_fp8,
                                                   quantize_mla_fp8)
from dsquant.runtime.layers.kv_cache import KVCacheSpec


@dataclass
class PagedContext:
    """Everything attention needs for one step; built by the model runner."""

    cos: torch.Tensor  # [1, T, rot/2] fp32
    sin: torch.Tensor  # [1, T, rot/2] fp32
    slot_mapping: torch.Tensor  # [T] int64 (-1: padding, not stored)
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    max_q_len: int = 1
    max_seq_len: int = 1
    is_decode: bool = False  # every sequence has exactly one new token
    q_lens_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)


class PagedAttentionBase:
    """Holds the caches and maps each attention module to its layer index (models.layers
    PagedAttentionBackend)."""

    mla_fused = None  # the Triton backend's fused MLA (attention_triton.py); none here

    def __init__(self):
        self.layer_index: dict = {}
        self.kv_caches: list[tuple] = []
        self.spec = KVCacheSpec()

    def bind(self, model, kv_caches: list[tuple], spec: KVCacheSpec | None = None) -> None:
        """Use kv_caches (one tuple per layer, as kv_cache.allocate_kv_caches makes for `spec`)."""
        self.layer_index = {layer.self_attn: i for i, layer in enumerate(model.model.layers)}
        self.kv_caches = kv_caches
        self.spec = spec or KVCacheSpec(dtype=kv_caches[0][0].dtype if kv_caches else torch.bfloat16)

    def prepare(self, decoder_layer) -> None:
        """Right after a layer loads, before its linears repack: nothing to take here."""

    def caches_of(self, module) -> tuple:
        return self.kv_caches[self.layer_index[module]]


def _slots(block_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(length, device=block_row.device)
    return block_row[pos // block_size].to(torch.int64) * block_size + pos % block_size  # [L]


def _causal(n_q: int, length: int, device) -> torch.Tensor:
    """[n_q, L] bool: query i (position L - n_q + i) sees keys 0 .. L - n_q + i."""
    qpos = torch.arange(length - n_q, length, device=device)[:, None]
    return torch.arange(length, device=device)[None, :] <= qpos


class TorchPagedAttention(PagedAttentionBase):
    """Reference paged attention in torch (the CPU path): store, gather per sequence, SDPA."""

    def gqa(self, module, q, k, v, ctx: PagedContext):
        # q [1, T, Hq, D]; k, v [1, T, Hkv, D] -> [1, T, Hq, D]
        caches = self.caches_of(module)
        block_size, hkv, d = caches[0].shape[1], caches[0].shape[2], caches[0].shape[3]
        k_flat, v_flat = caches[0].view(-1, hkv, d), caches[1].view(-1, hkv, d)  # [slots, Hkv, D]
        slots_new = ctx.slot_mapping  # [T]
        if self.spec.fp8:  # one scale per token and kv head
            ks_flat, vs_flat = caches[2].view(-1, hkv), caches[3].view(-1, hkv)  # [slots, Hkv] fp32
            k_flat[slots_new], ks_flat[slots_new] = quantize_fp8(k[0])
            v_flat[slots_new], vs_flat[slots_new] = quantize_fp8(v[0])
        else:
            k_flat[slots_new] = k[0].to(k_flat.dtype)
            v_flat[slots_new] = v[0].to(v_flat.dtype)
        out = torch.empty_like(q[0])  # [T, Hq, D]
        start = 0
        for b, (n_q, length) in enumerate(zip(ctx.q_lens_host, ctx.seq_lens_host)):
            slots = _slots(ctx.block_tables[b], length, block_size)
            if self.spec.fp8:
                keys = dequantize_fp8(k_flat[slots], ks_flat[slots]).to(q.dtype).transpose(0, 1)  # [Hkv, L, D]
                values = dequantize_fp8(v_flat[slots], vs_flat[slots]).to(q.dtype).transpose(0, 1)
            else:
                keys = k_flat[slots].to(q.dtype).transpose(0, 1)  # [Hkv, L, D]
                values = v_flat[slots].to(q.dtype).transpose(0, 1)
            qb = q[0, start:start + n_q].transpose(0, 1)  # [Hq, n, D]
            o = F.scaled_dot_product_attention(qb, keys, values, attn_mask=_causal(n_q, length, q.device),
                                               scale=module.scaling, enable_gqa=qb.shape[0] != hkv)
            out[start:start + n_q] = o.transpose(0, 1)
            start += n_q
        return out[None]

    def mla(self, module, q_nope, q_pe, kv_latent, k_pe, ctx: PagedContext):
        # q_nope [1, T, H, nope]; q_pe [1, T, H, rope]; kv_latent [1, T, R]; k_pe [1, T, rope]
        (kv_cache,) = self.caches_of(module)
        block_size, rank, rope = kv_cache.shape[1], module.kv_lora_rank, k_pe.shape[-1]
        flat = kv_cache.view(-1, kv_cache.shape[2])  # [slots, R + P], or uint8 [slots, W] (fp8)
        if self.spec.fp8:  # FlashMLA's token layout: e4m3 latent, its scales, the rope key
            flat[ctx.slot_mapping] = quantize_mla_fp8(kv_latent[0], k_pe[0], self.spec.rope_dtype)
        else:
            flat[ctx.slot_mapping] = torch.cat([kv_latent[0], k_pe[0]], dim=-1).to(kv_cache.dtype)
        h, nope, dv = module.num_heads, module.qk_nope_head_dim, module.v_head_dim
        out = q_nope.new_empty(q_nope.shape[1], h, dv)  # [T, H, v]
        q = torch.cat([q_nope[0], q_pe[0]], dim=-1)  # [T, H, nope + rope]
        start = 0
        for b, (n_q, length) in enumerate(zip(ctx.q_lens_host, ctx.seq_lens_host)):
            cached = flat[_slots(ctx.block_tables[b], length, block_size)]  # [L, R + P] (fp8: [L, W])
            if self.spec.fp8:
                cached = dequantize_mla_fp8(cached, rank, rope, self.spec.rope_dtype)
            cached = cached.to(q.dtype)  # [L, R + P]
            kv = module.kv_b_proj(cached[:, :rank]).view(length, h, nope + dv)
            k_nope, v = kv.split([nope, dv], dim=-1)
            pe = cached[:, None, rank:].expand(length, h, cached.shape[1] - rank)
            keys = torch.cat([k_nope, pe], dim=-1).transpose(0, 1)  # [H, L, nope + rope]
            qb = q[start:start + n_q].transpose(0, 1)  # [H, n, nope + rope]
            o = F.scaled_dot_product_attention(qb, keys, v.transpose(0, 1),
                                               attn_mask=_causal(n_q, length, q.device), scale=module.scaling)
            out[start:start + n_q] = o.transpose(0, 1)
            start += n_q
        return out[None]
