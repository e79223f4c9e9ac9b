"""Token sampling for a batch: greedy, temperature, top-k, top-p, per-request seeds.

All on the device: the only host read is the caller's `.tolist()` of the new tokens. Sampling
draws q ~ Exp(1) per vocabulary entry and takes argmax(p / q), which picks token i with
probability p_i (the exponential race); a seeded request draws its noise from its own
torch.Generator, so its tokens do not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsquant.runtime.engine.sequence import Sequence


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [S] fp32 (0: greedy)
    top_p: torch.Tensor  # [S] fp32
    top_k: torch.Tensor  # [S] int64 (vocab: off)
    any_random: bool
    any_top_p: bool
    any_top_k: bool
    generators: list  # per row: torch.Generator or None

    @classmethod
    def from_seqs(cls, seqs: list[Sequence], vocab: int, device) -> "SamplingTensors":
        ps = [s.params for s in seqs]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in ps]
        return cls(
            temperature=torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=device),
            top_p=torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            any_random=any(not p.greedy for p in ps),
            any_top_p=any(p.top_p < 1 and not p.greedy for p in ps),
            any_top_k=any(k < vocab for k, p in zip(top_k, ps) if not p.greedy),
            generators=[s.generator for s in seqs])


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


def sample(logits: torch.Tensor, t: SamplingTensors, default_generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [S, V] -> token ids [S] int64 (on the logits' device)."""
    logits = logits.to(torch.float32)
    greedy = logits.argmax(dim=-1)  # [S]
    if not t.any_random:
        return greedy
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
