"""Paged attention on CUDA through the Triton kernels (runtime/kernels), same context and caches
as the torch backend (attention.py).

GQA: store_kv, then paged_decode_attention when every sequence has one new token, else
paged_prefill_attention (causal varlen with the cached prefix; on Hopper with a model-dtype cache the
new tokens' keys come from k / v through TMA, prefill_tma.py, unless the cached prefix dominates:
new_keys_kwargs). MLA runs absorbed (design.md):
W_UK is folded into the query, the latent cache serves as key and value for all heads, and W_UV
is applied after attention. A prefill step whose FLOPs that favours (a long prompt's chunks) runs
unabsorbed instead (mla_prefill.py: per-head keys and values expanded from the cache, then causal
flash attention); a short one uses the decode kernel with one row per new token (mla_decode.prefill_rows). The absorbed W_UK [H, nope, R] and W_UV [H, v, R] are taken once from
kv_b_proj's dense (dequantized) weight.
`mla_fused` is the same attention from the projections' raw outputs in three launches
(mla_absorb.py): mla_prepare (q rope, W_UK, kv_a RMSNorm, k rope, cache store), the split decode
kernel, and mla_merge_uv (split merge and W_UV; decode-sized batches, else merge + einsum); the
kernel-path MLA module (layers/fused.py TritonMLAttention) calls it (other backends' mla_fused is None).
FP8 cache (self.spec.fp8, layers/kv_cache.py): the stores quantize (kv_store_fp8.py), the decode and
prefill kernels dequantize in registers. mla_fused then has mla_prepare write the normed latent and
rotated rope key to a [T, R + P] scratch buffer, which store_latent_fp8 quantizes into the cache (one
launch more than with the model-dtype cache).
"""
from __future__ import annotations

import torch

from dsquant.models.attention import MLAttention
from dsquant.runtime.layers.attention import PagedAttentionBase, PagedContext
from dsquant.runtime.layers.linear import QuantLinear


def new_keys_kwargs(ctx: PagedContext, k_new: torch.Tensor, v_new: torch.Tensor) -> dict:
    """paged_prefill_attention's k_new / v_new (the TMA kernel, prefill_tma.py, reads the new keys from them)
    unless the step is prefix-dominated: when the longest sequence's cached context is at least as long as
    the new tokens, the prefix, which that kernel reads through the pages with pointer loads, is most of
    the work, and the paged kernel did it faster (8192 new after 8192 cached: 0.87x on an H200, 0.96x on an
    H100; BENCHMARKS.md, thirtieth session)."""
    if ctx.max_seq_len - ctx.max_q_len >= ctx.max_q_len:
        return {}
    return {"k_new": k_new, "v_new": v_new}


EXPAND_MAX_BYTES = 2 << 30  # the unabsorbed prefill's per-layer k_nope + v (V2-Lite, 131072 keys: 1.07 GB)


class TritonPagedAttention(PagedAttentionBase):
    def __init__(self):
        super().__init__()
        self.absorbed: dict = {}  # module -> (w_uk [H, nope, R], w_uv [H, v, R])

    def prepare(self, decoder_layer) -> None:
        """Right after a layer loads, before its linears repack: take MLA's absorbed weights."""
        module = decoder_layer.self_attn
        if not isinstance(module, MLAttention):
            return
        proj: QuantLinear = module.kv_b_proj  # the runtime's linears are QuantLinears (layers/linear.py)
        w, dtype = proj.method.dequantized_weight(proj, torch.float32), proj.compute_dtype
        w = w.view(module.num_heads, module.qk_nope_head_dim + module.v_head_dim, module.kv_lora_rank)
        w_uk, w_uv = w.split([module.qk_nope_head_dim, module.v_head_dim], dim=1)  # [H, nope, R], [H, v, R]
        self.absorbed[module] = (w_uk.to(dtype).contiguous(), w_uv.to(dtype).contiguous())

    def _absorbed(self, module, dtype):
        w_uk, w_uv = self.absorbed[module]
        return w_uk.to(dtype), w_uv.to(dtype)

    def gqa(self, module, q, k, v, ctx: PagedContext):
        from dsquant.runtime.kernels.attention.kv_store import store_kv
        from dsquant.runtime.kernels.attention.paged_decode import paged_decode_attention
        from dsquant.runtime.kernels.attention.paged_prefill import paged_prefill_attention

        k_cache, v_cache, *scales = self.caches_of(module)  # scales: (k_scale, v_scale) with fp8
        if self.spec.fp8:
            from dsquant.runtime.kernels.attention.kv_store_fp8 import store_kv_fp8

            store_kv_fp8(k[0], v[0], k_cache, v_cache, *scales, ctx.slot_mapping)
            k_scale, v_scale = scales
        else:
            store_kv(k[0], v[0], k_cache, v_cache, ctx.slot_mapping)
            k_scale = v_scale = None
        if ctx.is_decode:
            out = paged_decode_attention(q[0], k_cache, v_cache, ctx.block_tables, ctx.seq_lens,
                                         module.scaling, max_seq_len=ctx.max_seq_len, k_scale=k_scale,
                                         v_scale=v_scale)
        else:
            out = paged_prefill_attention(q[0], k_cache, v_cache, ctx.block_tables, ctx.seq_lens,
                                          ctx.cu_seqlens_q, module.scaling, max_q_len=ctx.max_q_len,
                                          k_scale=k_scale, v_scale=v_scale, **new_keys_kwargs(ctx, k[0], v[0]))
        return out[None]  # [1, T, Hq, D]

    def mla(self, module, q_nope, q_pe, kv_latent, k_pe, ctx: PagedContext):
        (kv_cache,) = self.caches_of(module)
        self._store_latent(kv_latent[0], k_pe[0], kv_cache, ctx.slot_mapping)
        w_uk, w_uv = self._absorbed(module, q_nope.dtype)
        q_pe = q_pe[0]  # [T, H, rope], a view of q (the kernel takes its strides)
        if q_pe.stride(-1) != 1:
            q_pe = q_pe.contiguous()
        if self._unabsorbed(module, ctx):
            return self._attend_unabsorbed(module, q_nope[0], q_pe, kv_cache, ctx)
        q_abs = torch.einsum("thn,hnr->thr", q_nope[0], w_uk)  # q_nope [T, H, nope] -> absorbed [T, H, R]
        return self._attend_absorbed(module, q_abs, q_pe, kv_cache, w_uv, ctx)

    def mla_fused(self, module, q, latent, ctx: PagedContext):
        """q [1, T, H, nope + rope] (q projection, rope part rotated in place), latent [1, T, R + rope]
        (kv_a projection, before its RMSNorm) -> [1, T, H, v]."""
        from dsquant.runtime.kernels.attention.mla_absorb import mla_prepare

        (kv_cache,) = self.caches_of(module)
        w_uk, w_uv = self._absorbed(module, q.dtype)
        t, half = q.shape[1], module.qk_rope_head_dim // 2
        norm = module.kv_a_layernorm
        if self.spec.fp8:  # normed latent + rotated rope key to a scratch [T, 1, R + P], quantized from there
            target = torch.empty(t, 1, latent.shape[-1], dtype=latent.dtype, device=latent.device)
            slots = torch.arange(t, device=latent.device)
        else:
            target, slots = kv_cache, ctx.slot_mapping
        q_abs = mla_prepare(q[0], latent[0], norm.weight, norm.eps, ctx.cos.reshape(t, half),
                            ctx.sin.reshape(t, half), w_uk, target, slots, module.rope_interleave)  # [T, H, R]
        if self.spec.fp8:
            rank = module.kv_lora_rank
            self._store_latent(target[:, 0, :rank], target[:, 0, rank:], kv_cache, ctx.slot_mapping)
        q_pe = q[0, :, :, module.qk_nope_head_dim:]  # [T, H, rope], rotated
        if self._unabsorbed(module, ctx):  # (q_abs unused: one [T, nope] x [nope, R] product per head)
            return self._attend_unabsorbed(module, q[0, :, :, :module.qk_nope_head_dim], q_pe, kv_cache, ctx)
        return self._attend_absorbed(module, q_abs, q_pe, kv_cache, w_uv, ctx)

    def _store_latent(self, kv_c, k_pe, kv_cache, slot_mapping) -> None:
        """kv_c [T, R], k_pe [T, P] into the layer's latent cache (quantized when it is FP8)."""
        if self.spec.fp8:
            from dsquant.runtime.kernels.attention.kv_store_fp8 import store_latent_fp8

            store_latent_fp8(kv_c, k_pe, kv_cache, slot_mapping, self.spec.rope_dtype)
        else:
            from dsquant.runtime.kernels.attention.kv_store import store_latent

            store_latent(kv_c, k_pe, kv_cache, slot_mapping)

    @staticmethod
    def _unabsorbed(module, ctx: PagedContext) -> bool:
        """Whether this step's attention costs fewer FLOPs unabsorbed (keys and values expanded from the
        latent once per step, then per-head attention: mla_prefill.py) than absorbed, from the host-known
        lengths. Decode steps stay absorbed; a long prompt's chunks go unabsorbed (3.4x fewer FLOPs per
        query-key pair at DeepSeek's dims) unless the expanded keys and values would pass
        EXPAND_MAX_BYTES: the engine's memory profile (a fresh max_num_batched_tokens prefill) does not
        see them, so a long context on many heads (V3's 128 at one rank) stays absorbed."""
        from dsquant.runtime.kernels.attention.mla_prefill import supported

        nope, rope, vdim, rank = module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim, module.kv_lora_rank
        if ctx.is_decode or not supported(nope, rope, vdim):
            return False
        keys = sum(ctx.seq_lens_host)
        if keys * module.num_heads * (nope + vdim) * 2 > EXPAND_MAX_BYTES:  # bf16 k_nope + v, not in the memory profile
            return False
        pairs = sum(q * (n - q / 2) for q, n in zip(ctx.q_lens_host, ctx.seq_lens_host))  # causal (query, key) pairs
        absorbed = pairs * (2 * rank + rope)
        unabsorbed = keys * rank * (nope + vdim) + pairs * (nope + rope + vdim)
        return unabsorbed < absorbed

    def _attend_unabsorbed(self, module, q_nope, q_pe, kv_cache, ctx: PagedContext):
        """q_nope [T, H, nope] (not absorbed), q_pe [T, H, rope] over every cached key expanded per head
        -> [1, T, H, v]."""
        from dsquant.runtime.kernels.attention.mla_prefill import expand_keys, mla_prefill_attention

        w_uk, w_uv = self._absorbed(module, q_nope.dtype)
        k_nope, k_pe, v, cu_k = expand_keys(kv_cache, ctx.block_tables, ctx.seq_lens, sum(ctx.seq_lens_host), w_uk,
                                            w_uv, module.qk_rope_head_dim, self.spec.rope_dtype if self.spec.fp8 else None)
        return mla_prefill_attention(q_nope, q_pe, k_nope, k_pe, v, ctx.cu_seqlens_q, cu_k, ctx.max_q_len,
                                     module.scaling)[None]

    def _attend_absorbed(self, module, q_abs, q_pe, kv_cache, w_uv, ctx: PagedContext):
        """q_abs [T, H, R], q_pe [T, H, rope] over the latent cache, back through W_UV -> [1, T, H, v]."""
        from dsquant.runtime.kernels.attention.mla_absorb import MERGE_UV_MAX_ROWS, mla_merge_uv
        from dsquant.runtime.kernels.attention.mla_decode import mla_decode_attention, mla_decode_split, prefill_rows
        from dsquant.runtime.kernels.attention.split_kv_merge import merge_splits

        t = q_abs.shape[0]
        if ctx.is_decode:
            block_tables, seq_lens = ctx.block_tables, ctx.seq_lens
        else:
            block_tables, seq_lens = prefill_rows(ctx.cu_seqlens_q, ctx.seq_lens, ctx.block_tables, t)
        parts = mla_decode_split(q_abs, q_pe, kv_cache, block_tables, seq_lens, module.scaling,
                                 max_seq_len=ctx.max_seq_len)
        if parts is not None and t <= MERGE_UV_MAX_ROWS:
            return mla_merge_uv(*parts, w_uv)[None]  # [1, T, H, v]
        if parts is not None:
            latent_out = torch.empty_like(q_abs)
            merge_splits(*parts, latent_out)
        else:
            latent_out = mla_decode_attention(q_abs, q_pe, kv_cache, block_tables, seq_lens, module.scaling,
                                              max_seq_len=ctx.max_seq_len)  # [T, H, R]
        return torch.einsum("thr,hvr->thv", latent_out, w_uv)[None]
