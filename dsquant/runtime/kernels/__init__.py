"""The runtime's Triton kernels (and their torch references), by family:

  gemm/       quantized GEMMs and GEMVs: W4A16 (AWQ INT4, repacked), FP8 block, split-K, configs
  moe/        fused MoE: routing, alignment, grouped GEMMs / GEMVs, the weighted sum, the reference
  attention/  paged attention (GQA decode and prefill, MLA decode), split-KV merge, KV-cache stores
  ops/        RMSNorm, SiLU-and-mul, rope, argmax

Each kernel's module docstring states its tensor layouts.
"""
