"""Fused MoE: routing, token alignment, grouped GEMMs and GEMVs (bf16, INT4, FP8), the weighted sum, the torch reference."""
