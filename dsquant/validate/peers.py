"""Peers measured in the same report: bitsandbytes NF4 and INT8 applied to the baseline.

transformers quantizes the baseline's nn.Linear layers with bitsandbytes as it loads. In
transformers 5, DeepSeek's routed experts are fused 3D parameters rather than nn.Linear, so
bitsandbytes leaves them unquantized; the report says so. Accuracy is measured on the same
windows as the artifacts; latency is not (these peers do not run in dsquant's engine).
"""
from __future__ import annotations

import importlib.util

import torch

PEERS = {
    "bnb-nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "bnb-int8": dict(load_in_8bit=True),
}


class HFLogits:
    """Adapts a transformers causal LM to `model(input_ids) -> logits` as accuracy.compare calls it."""

    def __init__(self, model):
        self.model = model

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits


def bitsandbytes_available() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def load_peer(name: str, baseline: str, device: str):
    """(model adapter, notes) for a bitsandbytes peer of the baseline checkpoint."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs = dict(PEERS[name])
    compute = torch.bfloat16 if device == "cuda" else torch.float32
    if kwargs.get("load_in_4bit"):
        kwargs["bnb_4bit_compute_dtype"] = compute
    model = AutoModelForCausalLM.from_pretrained(baseline, quantization_config=BitsAndBytesConfig(**kwargs),
                                                 dtype=compute, device_map=device)
    notes = []
    if any(type(m).__name__.endswith("Experts") for m in model.modules()):
        notes.append("routed experts are fused 3D parameters in transformers 5 and stay unquantized "
                     "(bitsandbytes replaces nn.Linear only)")
    notes.append("latency not measured (runs in transformers, not dsquant's engine)")
    return HFLogits(model.eval()), notes
