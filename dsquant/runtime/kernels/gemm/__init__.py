"""Quantized GEMM / GEMV kernels: W4A16 (AWQ INT4) and FP8 block, their configs, split-K and activation quantization."""
