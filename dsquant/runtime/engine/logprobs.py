"""Log-probabilities the sampling parameters ask for: of each sampled token (`logprobs`) and of each
prompt token (`prompt_logprobs`), with the top N alternatives, recorded on the sequences.

Each entry is (logprob of the token, {token id: logprob} of the N most likely), from the fp32
log-softmax of the step's logits: what vLLM's and OpenAI's `logprobs` / `top_logprobs` report.
"""
from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, seqs, idx, kind: str) -> list[tuple[float, dict]]:
    """(logprob of target, {id: logprob} of the top N) per row; logits [R, V], targets [R]; row j's N is
    seqs[idx[j]].params.<kind>."""
    lp = logits.float().log_softmax(-1)  # [R, V]
    chosen = lp.gather(-1, targets[:, None])[:, 0].tolist()
    n = max(getattr(seqs[i].params, kind) for i in idx)
    top_lp, top_ids = lp.topk(n, dim=-1) if n else (lp[:, :0], lp[:, :0].long())
    out = []
    for j, (i, value) in enumerate(zip(idx, chosen)):
        k = getattr(seqs[i].params, kind)
        out.append((value, dict(zip(top_ids[j, :k].tolist(), top_lp[j, :k].tolist()))))
    return out


def record_sampled_logprobs(seqs, logits: torch.Tensor, tokens: torch.Tensor) -> None:
    """Append to seq.logprobs the entry of its sampled token, for the sequences that ask;
    logits [S, V], tokens [S] (row i: seqs[i])."""
    want = [i for i, s in enumerate(seqs) if s.logprobs is not None]
    if want:
        rows = torch.tensor(want, device=logits.device)
        for i, entry in zip(want, token_logprobs(logits[rows], tokens[rows], seqs, want, "logprobs")):
            seqs[i].logprobs.append(entry)


def record_prompt_logprobs(spans, logits: torch.Tensor) -> None:
    """spans: (seq, start, count) each; logits [sum of counts, V]: score prompt tokens
    start + 1 .. start + count of each span into seq.prompt_logprobs."""
    row = 0
    for seq, start, count in spans:
        targets = torch.tensor(seq.token_ids[start + 1:start + 1 + count], device=logits.device)
        entries = token_logprobs(logits[row:row + count], targets, [seq] * count, range(count), "prompt_logprobs")
        seq.prompt_logprobs[start + 1:start + 1 + count] = entries
        row += count
