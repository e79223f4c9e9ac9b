"""Elementwise and small fused ops: RMSNorm (+ residual), SiLU-and-mul, rope, argmax."""
