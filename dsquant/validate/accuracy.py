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
    windows: int = 0  # how many windows the interval comes from (1: none, low == high == value)


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
        return Interval(mean, mean, mean, len(per_window))
    half = 1.96 * float(x.std()) / math.sqrt(len(per_window))
    return Interval(mean, mean - half, mean + half, len(per_window))


LOGITS_BUDGET = 256 << 20  # bytes of float32 logits one forward may return (windows per batch follow)
CHUNK = 256  # scored positions per lm_head / log-softmax / KL step: temporaries of CHUNK x V floats


class ScoredLogits:
    """The float32 logits [n, V] of a window's n scored predictions, produced CHUNK rows at a time:
    from the hidden states through the model's head (a CausalLM: no [n, V] tensor is ever whole),
    or sliced from full logits (any other model: one window's logits)."""

    def __init__(self, rows: torch.Tensor, head=None):
        self.rows = rows  # [n, H] hidden states (head given) or [n, V] logits
        self.head = head

    def chunk(self, start: int, stop: int) -> torch.Tensor:
        part = self.rows[start:stop]
        return (self.head(part) if self.head is not None else part).float()  # [stop - start, V]


@torch.no_grad()
def window_logits(model, tokens: torch.Tensor, window: int, stride: int, device, batch: int = 4):
    """Yield (EvalWindow, ScoredLogits of the scored predictions, targets [n_scored]).

    A model with `hidden_states` / `logits` (dsquant's CausalLM) has its head applied CHUNK
    positions at a time, and runs up to `batch` windows at a time while their attention scores
    stay within LOGITS_BUDGET. Any other model returns full logits, and its windows run fewer at a
    time when their logits would pass LOGITS_BUDGET (a 49K vocabulary at window 2048 is 400 MB a
    window). Either way memory is bounded by the window and the vocabulary,
    never by the number of evaluated tokens."""
    split = hasattr(model, "hidden_states") and hasattr(model, "logits")
    heads = getattr(getattr(model, "config", None), "num_attention_heads", 1)
    windows = sliding_windows(tokens.numel(), window, stride)
    vocab, i = None, 0
    while i < len(windows):
        if split:  # eager attention's fp32 scores [B, heads, T, T] are then the largest temporary
            per_window = heads * window * window * 4
            n = max(1, min(batch, LOGITS_BUDGET // per_window))
        else:
            per_window = window * (vocab or 1) * 4
            n = 1 if vocab is None else max(1, min(batch, LOGITS_BUDGET // per_window))
        group = windows[i:i + n]
        k = 1  # the run of equal-length windows that starts the group (a shorter last one waits)
        while k < len(group) and group[k].end - group[k].start == group[0].end - group[0].start:
            k += 1
        group = group[:k]
        i += k
        ids = torch.stack([tokens[w.start:w.end] for w in group]).to(device)  # [B, T]
        out = model.hidden_states(ids) if split else model(ids)  # [B, T, H] or [B, T, V]
        vocab = None if split else out.shape[-1]
        for row, w in enumerate(group):  # in window order, whatever the batch: compare zips iterators
            keep = slice(ids.shape[1] - 1 - w.n_scored, ids.shape[1] - 1)  # predicts tokens 1..T-1
            yield w, ScoredLogits(out[row, keep], model.logits if split else None), ids[row, 1:][keep.start:]
        del out


def _window_stats(base: ScoredLogits, art: ScoredLogits | None, target: torch.Tensor):
    """(baseline NLL sum, artifact NLL sum, per-token KL(base || artifact) [n], argmax agreements),
    CHUNK positions at a time; target [n]. art None: the baseline's NLL alone."""
    base_nll = nll = agree = 0.0
    kls = []
    for c in range(0, target.numel(), CHUNK):
        base_lp = torch.log_softmax(base.chunk(c, c + CHUNK), dim=-1)  # [c, V]
        t = target[c:c + CHUNK, None]
        base_nll -= float(base_lp.gather(-1, t).sum())
        if art is None:
            continue
        lp = torch.log_softmax(art.chunk(c, c + CHUNK), dim=-1)
        nll -= float(lp.gather(-1, t).sum())
        kls.append((base_lp.exp() * (base_lp - lp)).sum(-1).clamp(min=0))  # [c]
        agree += float((lp.argmax(-1) == base_lp.argmax(-1)).sum())
    return base_nll, nll, (torch.cat(kls) if kls else None), agree


@torch.no_grad()
def compare(baseline, artifacts: dict, tokens: torch.Tensor, name: str, window: int, stride: int,
            device) -> tuple[SetAccuracy, dict[str, SetAccuracy]]:
    """Baseline and every artifact on the same windows of `tokens` [N]; one window's logits per
    model are alive at a time."""
    base_stats, art_stats = WindowStats(), {k: WindowStats() for k in artifacts}
    base_iter = window_logits(baseline, tokens, window, stride, device)
    art_iters = {k: window_logits(m, tokens, window, stride, device) for k, m in artifacts.items()}
    for w, base_logits, target in base_iter:
        base_stats.counts.append(w.n_scored)
        base_nll = None
        for key, it in art_iters.items():
            _, logits, _ = next(it)
            b_nll, nll, kl, agree = _window_stats(base_logits, logits, target)  # one chunk alive at a time
            base_nll = b_nll
            s = art_stats[key]
            s.nll.append(nll)
            s.kl.append(float(kl.sum()))
            s.kl_tokens.append(kl.cpu())
            s.agree.append(agree)
            s.counts.append(w.n_scored)
            del logits
        if base_nll is None:  # no artifacts: the baseline's perplexity alone
            base_nll = _window_stats(base_logits, None, target)[0]
        base_stats.nll.append(base_nll)
    n_tokens = int(tokens.numel())

    def ppl(stats):
        iv = _interval(stats.nll, stats.counts)
        return Interval(math.exp(iv.value), math.exp(iv.low), math.exp(iv.high), iv.windows)

    base = SetAccuracy(name, n_tokens, window, stride, ppl(base_stats))
    results = {}
    for key, s in art_stats.items():
        all_kl = torch.cat(s.kl_tokens)
        results[key] = SetAccuracy(name, n_tokens, window, stride, ppl(s), _interval(s.kl, s.counts),
                                   float(torch.quantile(all_kl.double(), 0.99)), _interval(s.agree, s.counts))
    return base, results
