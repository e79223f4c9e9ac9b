"""Sampling penalties and logit bias, with vLLM's semantics, applied to a batch's logits on the device.

In order (as vLLM's sampler): logit_bias is added by token id; then repetition_penalty r scales
the logit of every token seen in the prompt or the output (a positive logit is divided by r, a
negative one multiplied by r); then frequency_penalty f and presence_penalty p subtract
f * count and p * (count > 0), count being how often the token occurs in the generated tokens.

Built only for a step in which some sampling row asks for one of them (`from_seqs` returns None
otherwise), so the default path does no extra work. Everything is vectorized: the token ids of the
rows go to the device padded to one length, and counts and masks come from one scatter_add each.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsquant.runtime.engine.sequence import Sequence


def _padded(rows: list[list[int]], pad: int) -> list[int]:
    width = max((len(r) for r in rows), default=0) or 1
    out: list[int] = []
    for r in rows:
        out += r
        out += [pad] * (width - len(r))
    return out


@dataclass
class PenaltyTensors:
    presence: torch.Tensor  # [S] fp32
    frequency: torch.Tensor  # [S] fp32
    repetition: torch.Tensor  # [S] fp32
    output_ids: torch.Tensor  # [S, Lo] int64, padded with vocab
    prompt_ids: torch.Tensor | None  # [S, Lp] int64, padded with vocab; None when no row has repetition
    bias_index: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) [N] each
    bias_values: torch.Tensor | None  # [N] fp32

    @classmethod
    def from_seqs(cls, seqs: list[Sequence], vocab: int, device) -> PenaltyTensors | None:
        """The penalties of the sampling rows `seqs`, or None when none of them has any."""
        ps = [s.params for s in seqs]
        if not any(p.has_penalties for p in ps):
            return None

        def ids(values):  # token ids < 0 are async placeholders (never here: such steps drain first)
            return [t for t in values if 0 <= t < vocab]

        def f32(values):
            return torch.tensor(values, dtype=torch.float32, device=device)

        out_rows = [ids(s.completion_token_ids) if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1
                    else [] for s, p in zip(seqs, ps)]
        output_ids = torch.tensor(_padded(out_rows, vocab), device=device).view(len(seqs), -1)
        prompt_ids = None
        if any(p.repetition_penalty != 1 for p in ps):
            rows = [ids(s.prompt_token_ids) if p.repetition_penalty != 1 else [] for s, p in zip(seqs, ps)]
            prompt_ids = torch.tensor(_padded(rows, vocab), device=device).view(len(seqs), -1)
        bias_index = bias_values = None
        if any(p.logit_bias for p in ps):
            r, c, v = [], [], []
            for i, p in enumerate(ps):
                for token, bias in (p.logit_bias or {}).items():
                    if 0 <= token < vocab:
                        r.append(i), c.append(token), v.append(bias)
            bias_index = (torch.tensor(r, dtype=torch.int64, device=device),
                          torch.tensor(c, dtype=torch.int64, device=device))
            bias_values = f32(v)
        return cls(f32([p.presence_penalty for p in ps]), f32([p.frequency_penalty for p in ps]),
                   f32([p.repetition_penalty for p in ps]), output_ids, prompt_ids, bias_index, bias_values)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [S, V] fp32 -> penalized logits [S, V] fp32 (a new tensor)."""
        logits = logits.clone()
        s, vocab = logits.shape
        if self.bias_index is not None:
            logits.index_put_(self.bias_index, self.bias_values, accumulate=True)
        counts = torch.zeros(s, vocab + 1, dtype=torch.float32, device=logits.device)  # column vocab: padding
        counts.scatter_add_(1, self.output_ids, torch.ones_like(self.output_ids, dtype=torch.float32))
        counts = counts[:, :vocab]  # [S, V] occurrences in the output
        if self.prompt_ids is not None:
            seen = torch.zeros(s, vocab + 1, dtype=torch.bool, device=logits.device)
            seen.scatter_(1, self.prompt_ids, True)
            seen = seen[:, :vocab] | (counts > 0)  # [S, V] in the prompt or the output
            r = self.repetition[:, None]
            scaled = torch.where(logits > 0, logits / r, logits * r)
            logits = torch.where(seen, scaled, logits)
        logits -= self.frequency[:, None] * counts
        logits -= self.presence[:, None] * (counts > 0).to(torch.float32)
        return logits
