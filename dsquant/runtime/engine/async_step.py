"""Async scheduling: step N + 1 is launched before step N's sampled tokens reach the host.

A synchronous step is schedule -> prepare -> launch -> read the tokens -> host post-processing
(append, prefix-cache registration, detokenize, stop checks, outputs), and the GPU idles through
the read and the post-processing. With EngineConfig.async_scheduling, LLMEngine.step() runs:

    [drain: read + post-process step N, when the rule below says so]
    schedule N + 1 -> prepare N + 1 -> launch N + 1
    read step N's tokens (an event wait on a pinned copy) -> post-process step N   <- GPU runs N + 1
    return step N's outputs

so each step() returns the outputs of the step launched by the previous call, and one more call
flushes the last one (has_unfinished() stays true while a step is in flight).

Bookkeeping at launch (`launch_step`): every scheduled sequence's num_computed_tokens advances
by its tokens (their K/V are being written, stream-ordered before anything later), and each
sequence that samples gets a placeholder token id -(k + 1), k being its row in the step's sampled
tokens. The scheduler then sees it as a decode. When step N + 1 is prepared, a placeholder input
id is replaced on the device from step N's sampled-token tensor (ModelRunner.prepare: one
device copy, or an index_copy when the rows are not in order); the host never reads it. Post-
processing (`LLMEngine._finish_step`) writes the real tokens over the placeholders. A sequence
whose in-flight token reaches max_tokens or max_model_len is marked ENDING and not scheduled
again; one that stops on a stop token, EOS or stop string is only known to stop when its token
is read, so step N + 1 may have computed one more token for it: that token is dropped, never
returned, and the sequence's blocks are freed at once (later GPU work is stream-ordered after
N + 1, which is the last to touch them).

The overlap is kept narrow. Step N is drained (post-processed before step N + 1 is scheduled, so
step N + 1 sees every token on the host) when
  - a sequence in step N asks for logprobs or prompt_logprobs (they are appended at launch and
    must not run ahead of the outputs), or for penalties or logit_bias (they read its generated
    tokens on the host), or
  - the running sequences' next tokens may not fit in the free KV blocks, so scheduling could
    preempt (Scheduler.fits_without_preemption): a preempted sequence is recomputed from its
    host tokens, which must all be known.
Otherwise step N + 1 holds only decodes of running sequences (their input is step N's token, on
the device) and prefill chunks of prompts, whose ids are known. After a drain step N + 1 is still
launched and left in flight. Prefix-cache blocks are registered at post-processing, once their
tokens are known, so a request arriving while a sharer is running may hit one block less than
in the synchronous engine; tokens never differ. Tensor parallelism runs synchronously (its step
payload is read on the host). On CPU there is no real overlap, but the same bookkeeping runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsquant.runtime.engine.scheduler import ScheduledBatch, Scheduler
from dsquant.runtime.engine.sequence import Sequence, SequenceStatus


@dataclass
class SampledTokens:
    """A step's sampled tokens: on the device (the next step's input ids read them there) and
    on their way to the host."""

    device: torch.Tensor  # [S] int64
    host: torch.Tensor  # [S] int64: a pinned copy on CUDA, `device` itself on CPU
    ready: torch.cuda.Event | None = None  # recorded after the device -> host copy (CUDA)

    def tolist(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()  # this copy only, not the whole stream
        return self.host.tolist()


class TokenReadback:
    """Device -> host copies of sampled tokens without a stream sync: a non-blocking copy into
    one of two pinned buffers, then an event. Two suffice: the engine reads step N's tokens
    before it launches step N + 2, which reuses N's buffer."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * 2
        self.events = [torch.cuda.Event() for _ in range(2)] if self.cuda else []
        self.turn = 0

    def start(self, tokens: torch.Tensor) -> SampledTokens:
        """tokens [S] int64 on the device -> SampledTokens whose host copy is queued."""
        if not self.cuda:
            return SampledTokens(tokens, tokens)
        i, n = self.turn, tokens.shape[0]
        self.turn ^= 1
        if self.buffers[i].shape[0] < n:
            self.buffers[i] = torch.empty(max(n, 64, 2 * self.buffers[i].shape[0]), dtype=torch.int64,
                                          pin_memory=True)
        host = self.buffers[i][:n]
        host.copy_(tokens, non_blocking=True)
        self.events[i].record()
        return SampledTokens(tokens, host, self.events[i])


@dataclass
class LaunchedStep:
    """A step whose GPU work is queued and whose tokens the host has not read yet."""

    seqs: list[Sequence]
    token_index: list[int]  # per seq: where its (first) sampled token goes in seq.token_ids, -1: samples nothing
    tokens: SampledTokens | None  # None when no sequence samples
    steps: int = 1  # > 1: a multi-step burst (multi_step.py), tokens [steps * S] step-major


def launch_step(runner, batch: ScheduledBatch, max_model_len: int,
                pending: LaunchedStep | None = None, steps: int = 1) -> LaunchedStep:
    """Launch `batch` (its placeholder input ids read `pending`'s tokens on the device) and
    advance the sequences as if its tokens were known: computed counts, placeholders, ENDING.
    steps > 1: a burst of decode steps; sampling row k of step j is the placeholder -(j S + k + 1)."""
    samples = batch.samples()
    batch.prev_tokens = pending.tokens.device if pending is not None and pending.tokens is not None else None
    tokens = runner.launch(batch, steps)
    width = sum(samples)
    token_index, k = [], 0
    for seq, n, samp in zip(batch.seqs, batch.num_new_tokens, samples):
        seq.num_computed_tokens += n + steps - 1
        if not samp:
            token_index.append(-1)
            continue
        index = len(seq.token_ids)
        token_index.append(index)
        if steps == 1:
            seq.token_ids.append(-1 - k)  # placeholder: row k of `tokens`
        else:
            seq.token_ids += [-1 - (j * width + k) for j in range(steps)]
        k += 1
        if seq.ends_by_length(index + steps, max_model_len):
            seq.status = SequenceStatus.ENDING
    return LaunchedStep(batch.seqs, token_index, tokens, steps)


def must_drain(pending: LaunchedStep, scheduler: Scheduler) -> bool:
    """Whether `pending` must be post-processed before the next schedule (the rule above)."""
    if any(s.logprobs is not None or s.prompt_logprobs is not None or s.params.has_penalties for s in pending.seqs):
        return True
    return not scheduler.fits_without_preemption()


def fill_placeholders(input_ids: torch.Tensor, n: int, in_order: bool, extra: list[torch.Tensor],
                       prev_tokens: torch.Tensor | None) -> list[torch.Tensor]:
    """Write the previous step's sampled tokens over the n placeholder input ids, on the device;
    return the rest of `extra` (the sampling fields). in_order: rows 0..n-1 take prev_tokens[:n];
    else extra starts with the rows and their source rows in prev_tokens (int64 each)."""
    assert prev_tokens is not None, "placeholder input ids without the previous step's tokens"
    if not in_order:
        rows, src, *extra = extra
        input_ids.index_copy_(0, rows, prev_tokens.index_select(0, src))
    else:
        input_ids[:n].copy_(prev_tokens if prev_tokens.shape[0] == n else prev_tokens[:n])
    return extra
