"""The paged KV cache's tensors: their dtype (`--kv-cache-dtype`), shapes, allocation and size.

Per decoder layer, a tuple of tensors shared by the torch backend (attention.py) and the Triton
kernels (runtime/kernels/attention/kv_store*.py):
  auto (the model dtype)
    GQA  (k_cache, v_cache)                    each [num_blocks, block_size, Hkv, D]
    MLA  (kv_cache,)                           [num_blocks, block_size, R + P] (latent, then rope key)
  fp8 (e4m3 with dynamic scales; layouts in runtime/kernels/attention/kv_fp8_layout.py)
    GQA  (k_cache, v_cache, k_scale, v_scale)  float8_e4m3fn [num_blocks, block_size, Hkv, D] and
                                               float32 [num_blocks, block_size, Hkv], per token and head
    MLA  (kv_cache,)                           uint8 [num_blocks, block_size, R + 4R/128 + 2P]
                                               (FlashMLA's 656-byte token at R 512, P 64)
The block manager counts blocks; the memory a block costs (bytes_per_block) is what sizes the
cache, so an FP8 cache holds more tokens in the same memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsquant.errors import DsquantError
from dsquant.runtime.kernels.attention.kv_fp8_layout import FP8_DTYPE, fp8_rope_dtype, mla_fp8_groups, mla_fp8_token_bytes

KV_CACHE_DTYPES = ("auto", "fp8")
KV_CACHE_ALIASES = {"fp8_e4m3": "fp8"}  # vLLM's spelling of the same thing


def check_kv_cache_dtype(value: str, flag: str = "kv_cache_dtype") -> str:
    """`value` normalised to one of KV_CACHE_DTYPES; a DsquantError naming `flag` otherwise."""
    name = KV_CACHE_ALIASES.get(value, value)
    if name in KV_CACHE_DTYPES:
        return name
    hint = " (dsquant's FP8 cache is e4m3)" if value == "fp8_e5m2" else ""
    raise DsquantError(f"{flag} {value!r}: expected auto (the model dtype) or fp8 (e4m3 with per-token "
                       f"scales; also spelled fp8_e4m3){hint}")


@dataclass(frozen=True)
class KVCacheSpec:
    """What the KV cache holds: kv_cache_dtype "auto" (the model dtype) or "fp8"; `dtype` is the
    model's activation dtype (the cache dtype under auto, the rope dtype's source under fp8)."""

    kv_cache_dtype: str = "auto"
    dtype: torch.dtype = torch.bfloat16

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype == "fp8"

    @property
    def label(self) -> str:
        """The cache dtype as /metrics and logs name it."""
        return "fp8_e4m3" if self.fp8 else str(self.dtype).removeprefix("torch.")

    @property
    def rope_dtype(self) -> torch.dtype:
        return fp8_rope_dtype(self.dtype)

    def tensors(self, cfg, num_blocks: int, block_size: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each cache tensor of one layer (see the module docstring)."""
        if cfg.is_deepseek:
            rank, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
            if not self.fp8:
                return [((num_blocks, block_size, rank + rope), self.dtype)]
            try:
                mla_fp8_groups(rank)
            except ValueError as e:
                raise DsquantError(f"--kv-cache-dtype fp8: {e}") from None
            return [((num_blocks, block_size, mla_fp8_token_bytes(rank, rope)), torch.uint8)]
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.dense_head_dim)
        if not self.fp8:
            return [(shape, self.dtype)] * 2
        return [(shape, FP8_DTYPE)] * 2 + [(shape[:3], torch.float32)] * 2

    def bytes_per_token(self, cfg) -> int:
        """KV-cache bytes one token costs, over all layers."""
        per_layer = sum(torch.Size(s[2:]).numel() * torch.empty((), dtype=d).element_size()
                        for s, d in self.tensors(cfg, 1, 1))
        return per_layer * cfg.num_hidden_layers


def kv_cache_shapes(cfg, num_blocks: int, block_size: int, spec: KVCacheSpec = KVCacheSpec()) -> list[tuple]:
    """Shape of each cache tensor of one layer (GQA: two, or four with fp8; MLA: one)."""
    return [s for s, _ in spec.tensors(cfg, num_blocks, block_size)]


def allocate_kv_caches(cfg, spec: KVCacheSpec, num_blocks: int, block_size: int, device) -> list[tuple]:
    """Per layer, a tuple of zeroed cache tensors (see KVCacheSpec.tensors)."""
    return [tuple(torch.zeros(s, dtype=d, device=device) for s, d in spec.tensors(cfg, num_blocks, block_size))
            for _ in range(cfg.num_hidden_layers)]


def kv_bytes_per_block(cfg, block_size: int, spec: KVCacheSpec) -> int:
    return spec.bytes_per_token(cfg) * block_size
