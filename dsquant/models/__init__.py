"""Pure-PyTorch model code for DeepSeek V2/V3, Llama and Qwen2, checked against transformers."""
from dsquant.models.causal_lm import CausalLM, DecoderLayer
from dsquant.models.layers import Backends
from dsquant.models.loader import load_model, open_model

__all__ = ["Backends", "CausalLM", "DecoderLayer", "load_model", "open_model"]
