"""Where a loaded model runs slower paths than its checkpoint's formats allow: quantized experts
dequantized to the model dtype (layers/moe.py FusedMoE.fallbacks) and MLA input projections the
runtime cannot fuse for want of a concatenation rule (layers/fused_linear.py). validate puts them
beside an artifact's latency (and tune beside its predictions), so a measured step that misses a
prediction names the path that cost it. Choices of the recipe (different formats, group sizes) are
not fallbacks.
"""
from __future__ import annotations

from torch import nn

from dsquant.runtime.layers.fused_linear import UNSUPPORTED


def kernel_fallbacks(model) -> list[str]:
    """One line per fallback of `model` (the runtime's loaded model), module names first; [] for an
    engine whose model lives in worker processes (tensor parallelism)."""
    if not isinstance(model, nn.Module):
        return []
    out = []
    for name, module in model.named_modules():
        backend = getattr(module, "backend", None)
        why = getattr(backend, "fallbacks", {}).get(module) if backend is not None else None
        if why:
            out.append(f"{name}: experts run dequantized ({why})")
        refused = getattr(module, "fusion_refused", None)
        if refused and refused.startswith(UNSUPPORTED):
            out.append(f"{name}: not fused with kv_a_proj_with_mqa ({refused})")
    return out
