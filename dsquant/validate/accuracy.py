"""Accuracy of an artifact against its baseline, on the same windows of held-out text.

Per evaluation set: perplexity (sliding windows, each token after the first scored once), the
mean and 99th percentile of the per-token KL divergence KL(baseline || artifact) of the
next-token distributions, and top-1 agreement (artifact's argmax equals the baseline's).
Each comes with a 95% interval from the spread over windows (normal approximation on the
per-window means; perplexity's interval is exp of the mean NLL's).

Models are built through the serving runtime (runtime.loader: every Linear runs its
quantized method, on CUDA the Triton kernels and fused MoE), with full-sequence attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dsquant.data import sliding_windows


@dataclass
class Interval:
    value: float
    low: float
    high: float


@dataclass
class SetAccuracy:
    name: str
    tokens: int
    window: int
    stride: int
    perplexity: Interval
    kl_mean: Interval | None = None
    kl_p99: float | None = None
    top1_agreement: Interval | None = None


@dataclass
class WindowStats:
    """Per-window sums, collected for the baseline (nll only) and each artifact."""

    nll: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    agree: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    kl_tokens: list[torch.Tensor] = field(default_factory=list)


def _interval(per_window: list[float], counts: list[int]) -> Interval:
    """Token-weighted mean over windows and a 95% interval from the windows' spread."""
    n = torch.tensor(counts, dtype=torch.float64)
    x = torch.tensor(per_window, dtype=torch.float64) / n  # per-window means
    mean = float((x * n).sum() / n.sum())
    if len(per_window) < 2:
        return Interval(mean, mean, mean)
    half = 1.96 * float(x.std()) / math.sqrt(len(per_window))
    return Interval(mean, mean - half, mean + half)


@torch.no_grad()
def window_logits(model, tokens: torch.Tensor, window: int, stride: int, device, batch: int = 4):
    """Yield (EvalWindow, logprobs of the scored predictions [n_scored, V] fp32, targets [n_scored])."""
    windows = sliding_windows(tokens.numel(), window, stride)
    for i in range(0, len(windows), batch):
        group = windows[i:i + batch]
        lengths = {w.end - w.start for w in group}
        subgroups = [[w for w in group if w.end - w.start == n] for n in sorted(lengths)]
        for sub in subgroups:
            ids = torch.stack([tokens[w.start:w.end] for w in sub]).to(device)  # [B, T]
            logits = model(ids).float()  # [B, T, V]
            logprobs = torch.log_softmax(logits[:, :-1], dim=-1)  # predicts tokens 1..T-1
            for row, w in enumerate(sub):
                keep = slice(ids.shape[1] - 1 - w.n_scored, None)
                yield w, logprobs[row, keep], ids[row, 1:][keep]


@torch.no_grad()
def compare(baseline, artifacts: dict, tokens: torch.Tensor, name: str, window: int, stride: int,
            device) -> tuple[SetAccuracy, dict[str, SetAccuracy]]:
    """Baseline and every artifact on the same windows of `tokens` [N]."""
    base_stats, art_stats = WindowStats(), {k: WindowStats() for k in artifacts}
    base_iter = window_logits(baseline, tokens, window, stride, device)
    art_iters = {k: window_logits(m, tokens, window, stride, device) for k, m in artifacts.items()}
    for w, base_lp, target in base_iter:
        base_stats.nll.append(-float(base_lp.gather(-1, target[:, None]).sum()))
        base_stats.counts.append(w.n_scored)
        base_p = base_lp.exp()
        base_top = base_lp.argmax(-1)
        for key, it in art_iters.items():
            _, lp, _ = next(it)
            s = art_stats[key]
            s.nll.append(-float(lp.gather(-1, target[:, None]).sum()))
            kl = (base_p * (base_lp - lp)).sum(-1).clamp(min=0)  # [n_scored]
            s.kl.append(float(kl.sum()))
            s.kl_tokens.append(kl.cpu())
            s.agree.append(float((lp.argmax(-1) == base_top).sum()))
            s.counts.append(w.n_scored)
    n_tokens = int(tokens.numel())

    def ppl(stats):
        iv = _interval(stats.nll, stats.counts)
        return Interval(math.exp(iv.value), math.exp(iv.low), math.exp(iv.high))

    base = SetAccuracy(name, n_tokens, window, stride, ppl(base_stats))
    results = {}
    for key, s in art_stats.items():
        all_kl = torch.cat(s.kl_tokens)
        results[key] = SetAccuracy(name, n_tokens, window, stride, ppl(s), _interval(s.kl, s.counts),
                                   float(torch.quantile(all_kl.double(), 0.99)), _interval(s.agree, s.counts))
    return base, results
