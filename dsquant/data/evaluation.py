"""Evaluation token streams and sliding-window perplexity.

A stream is every document of a set, in file order, each framed BOS + text + EOS and joined
into one 1-D LongTensor. Perplexity runs windows of `window` tokens that start every `stride`
tokens; each window scores only the predictions the previous windows did not, so every token
after the first is scored exactly once and, past the first window, with at least
`window - stride` tokens of context.
"""
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from dsquant.data.encoding import encode_documents
from dsquant.data.sources import EVAL_SETS, load_documents
from dsquant.errors import DsquantError


def eval_tokens(tokenizer, name: str | Path, max_tokens: int | None = None) -> torch.Tensor:
    """The token stream of "eval_prose", "eval_code" or a local source path: LongTensor [N]."""
    source = name if isinstance(name, str) and name in EVAL_SETS else Path(name)
    docs = load_documents(source, max_doc_chars=None)
    stream = [token for ids in encode_documents(tokenizer, docs) for token in ids]
    if max_tokens is not None:
        stream = stream[:max_tokens]
    if len(stream) < 2:
        raise DsquantError(f"{name}: gives {len(stream)} tokens, too few to evaluate (need at least 2)")
    return torch.tensor(stream, dtype=torch.long)


@dataclass(frozen=True)
class EvalWindow:
    start: int  # first input token of the window
    end: int  # one past the last input token
    n_scored: int  # predictions scored: the last n_scored targets of tokens[start + 1 : end]


def sliding_windows(n_tokens: int, window: int, stride: int) -> list[EvalWindow]:
    """Windows over a stream of n_tokens so that targets 1 .. n_tokens - 1 are each scored once."""
    if not 0 < stride < window:
        # stride == window would leave each window's first token unpredicted by any window
        raise DsquantError(f"perplexity needs 0 < stride < window (got stride={stride}, window={window})")
    windows, scored_to = [], 1  # targets [1, scored_to) are scored
    for start in range(0, n_tokens - 1, stride):
        end = min(start + window, n_tokens)
        windows.append(EvalWindow(start, end, end - scored_to))
        scored_to = end
        if end == n_tokens:
            break
    return windows


@dataclass(frozen=True)
class Perplexity:
    nll_sum: float  # natural-log negative log-likelihood summed over the scored tokens
    n_scored: int
    window: int
    stride: int

    @property
    def value(self) -> float:
        return math.exp(self.nll_sum / self.n_scored)


@torch.no_grad()
def sliding_window_perplexity(logits_fn, tokens: torch.Tensor, window: int = 512, stride: int = 256,
                              batch_size: int = 8) -> Perplexity:
    """Perplexity of `tokens` [N] under `logits_fn(input_ids [B, T]) -> logits [B, T, V]`.

    Windows of equal length are batched; the last, shorter window runs alone. The log-softmax
    is taken in float32 whatever the logits' dtype.
    """
    windows = sliding_windows(tokens.numel(), window, stride)
    nll_sum, n_scored = 0.0, 0
    groups: dict[int, list[EvalWindow]] = {}
    for w in windows:
        groups.setdefault(w.end - w.start, []).append(w)
    for length, group in groups.items():
        for i in range(0, len(group), batch_size):
            batch = group[i : i + batch_size]
            input_ids = torch.stack([tokens[w.start : w.end] for w in batch])  # [B, T]
            logits = logits_fn(input_ids)  # [B, T, V]
            logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # predicts tokens 1..T-1
            target_lp = logprobs.gather(-1, input_ids[:, 1:, None].to(logprobs.device))[..., 0]
            for row, w in enumerate(batch):
                nll_sum -= target_lp[row, length - 1 - w.n_scored :].sum().item()
                n_scored += w.n_scored
    return Perplexity(nll_sum, n_scored, window, stride)
