"""Token sampling for a batch: greedy, temperature, top-k, top-p, per-request seeds (after the
penalties and logit bias of penalties.py, when a row asks for them).

All on the device: the only host read is the caller's `.tolist()` of the new tokens. Sampling
draws q ~ Exp(1) per vocabulary entry and takes argmax(p / q), which picks token i with
probability p_i (the exponential race); a seeded request draws its noise from its own
torch.Generator, so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dsquant.runtime.engine.sequence import Sequence


@dataclass
class SamplingTensors:
    any_random: bool
    any_top_p: bool
    any_top_k: bool
    generators: list  # per row: torch.Generator or None
    # None when every row is greedy (nothing on the device is needed then)
    temperature: torch.Tensor | None = None  # [S] fp32 (0: greedy)
    top_p: torch.Tensor | None = None  # [S] fp32
    top_k: torch.Tensor | None = None  # [S] int32 (vocab: off)

    @staticmethod
    def host_fields(seqs: list[Sequence], vocab: int) -> list[tuple[list, torch.dtype]]:
        """(values, dtype) of temperature, top_p, top_k for the rows of seqs; [] when all greedy."""
        ps = [s.params for s in seqs]
        if all(p.greedy for p in ps):
            return []
        return [([p.temperature for p in ps], torch.float32), ([p.top_p for p in ps], torch.float32),
                ([p.top_k if 0 < p.top_k < vocab else vocab for p in ps], torch.int32)]

    @classmethod
    def build(cls, seqs: list[Sequence], vocab: int, tensors: list[torch.Tensor]) -> "SamplingTensors":
        """From the device tensors of host_fields(seqs, vocab), in that order (none: all greedy)."""
        ps = [s.params for s in seqs]
        t = cls(any_random=bool(tensors), any_top_p=any(p.top_p < 1 and not p.greedy for p in ps),
                any_top_k=any(0 < p.top_k < vocab and not p.greedy for p in ps),
                generators=[s.generator for s in seqs])
        if tensors:
            t.temperature, t.top_p, t.top_k = tensors
        return t

    @classmethod
    def from_seqs(cls, seqs: list[Sequence], vocab: int, device) -> "SamplingTensors":
        fields = cls.host_fields(seqs, vocab)
        return cls.build(seqs, vocab, [torch.tensor(v, dtype=d, device=device) for v, d in fields])


def _apply_top_k_top_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    # logits [S, V] fp32, already divided by temperature
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V]
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= t.top_k[:, None]
    if t.any_top_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop = drop | (before >= t.top_p[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, V] -> argmax [S] int64: the Triton two-stage argmax on CUDA (and under
    TRITON_INTERPRET for fp16/fp32, whose interpreter handles bf16 badly), else torch.argmax in fp32
    (the CPU's bf16 argmax is several times slower than converting first)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1" and logits.dtype != torch.bfloat16
    if logits.is_cuda or interpret:
        from dsquant.runtime.kernels.ops.argmax import argmax

        return argmax(logits)
    return logits.to(torch.float32).argmax(dim=-1)


def sample(logits: torch.Tensor, t: SamplingTensors, default_generator: torch.Generator | None = None,
           penalties=None, greedy: torch.Tensor | None = None) -> torch.Tensor:
    """logits [S, V] -> token ids [S] int64 (on the logits' device). penalties: a PenaltyTensors
    (penalties.py) applied first, or None (the default path: no extra work). greedy: the rows' argmax
    of these logits when already taken ([S] int64, the decode graph's), used unless penalties change them."""
    if penalties is not None:
        logits, greedy = penalties.apply(logits.to(torch.float32)), None
    if greedy is None:
        greedy = greedy_argmax(logits)  # [S]
    if not t.any_random:
        return greedy
    logits = logits.to(torch.float32)
    temp = torch.where(t.temperature > 0, t.temperature, torch.ones_like(t.temperature))
    scaled = logits / temp[:, None]
    if t.any_top_k or t.any_top_p:
        scaled = _apply_top_k_top_p(scaled, t)
    probs = scaled.softmax(dim=-1)  # [S, V]
    noise = torch.empty_like(probs)
    for i, gen in enumerate(t.generators):
        noise[i].exponential_(generator=gen or default_generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(t.temperature > 0, sampled, greedy)
