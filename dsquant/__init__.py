"""dsquant: quantize, serve and validate DeepSeek models."""

__version__ = "0.1.0"
