"""Full-sequence attention with the KV cache's numerics: what `dsquant validate --kv-cache-dtype`
runs, so the accuracy figures of an artifact include what its cache costs.

The paged cache stores each token's keys and values (MLA: latent and rope key) once and every
query reads them back, its own token included (attention.py, attention_triton.py). Attending
over quantize -> dequantize of the same tensors in one full-sequence pass is therefore the same
computation: `KVCacheRoundTrip` does that with the torch functions the paged torch backend uses
(kernels/attention/kv_fp8_layout.py), and with kv_cache_dtype auto it is plain EagerAttention.

`KVCacheSwitch` runs one loaded model under either cache dtype (it sets the backend's spec before
each forward), so the cost of the FP8 cache is measured against the same weights with the
model-dtype cache, without a second copy of the model.
"""
from __future__ import annotations

from dsquant.models.attention import EagerAttention
from dsquant.runtime.kernels.attention.kv_fp8_layout import dequantize_fp8, dequantize_mla_fp8, quantize_fp8, quantize_mla_fp8
from dsquant.runtime.layers.kv_cache import KVCacheSpec


class KVCacheRoundTrip(EagerAttention):
    def __init__(self, spec: KVCacheSpec):
        self.spec = spec

    def gqa(self, module, q, k, v, ctx):
        # k, v [B, T, Hkv, D]: one scale per token and head, as the paged cache keeps them
        if self.spec.fp8:
            k = dequantize_fp8(*quantize_fp8(k)).to(k.dtype)
            v = dequantize_fp8(*quantize_fp8(v)).to(v.dtype)
        return super().gqa(module, q, k, v, ctx)

    def mla(self, module, q_nope, q_pe, kv_latent, k_pe, ctx):
        # kv_latent [B, T, R], k_pe [B, T, P]: through the 656-byte token layout and back
        if self.spec.fp8:
            b, t, rank = kv_latent.shape
            rope = k_pe.shape[-1]
            rows = quantize_mla_fp8(kv_latent.reshape(b * t, rank), k_pe.reshape(b * t, rope), self.spec.rope_dtype)
            back = dequantize_mla_fp8(rows, rank, rope, self.spec.rope_dtype)  # [B*T, R + P] float32
            kv_latent = back[:, :rank].reshape(b, t, rank).to(kv_latent.dtype)
            k_pe = back[:, rank:].reshape(b, t, rope).to(k_pe.dtype)
        return super().mla(module, q_nope, q_pe, kv_latent, k_pe, ctx)


class KVCacheSwitch:
    """`model(ids)` with `backend` (the model's KVCacheRoundTrip) set to `spec` first."""

    def __init__(self, model, backend: KVCacheRoundTrip, spec: KVCacheSpec):
        self.model, self.backend, self.spec = model, backend, spec

    def __call__(self, ids):
        self.backend.spec = self.spec
        return self.model(ids)
