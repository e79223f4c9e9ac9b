"""Multi-step decoding: one scheduling round runs up to N decode steps back to back on the device.

With EngineConfig.num_scheduler_steps = N > 1 (vLLM's V0 `--num-scheduler-steps`), a batch of pure
decodes is launched as a burst of steps: the first is prepared on the host as usual (runner.prepare),
then each later step's inputs are advanced on the device from the step before it (the sampled
tokens become the input ids; positions and seq_lens grow by one; the slot of each new position is
read from the block table already on the device), and its forward and sampling are queued with no
host read in between. On CUDA each later step is one replay of a second decode graph per bucket
(cuda_graph.DecodeGraphs.burst_graphs, captured only when N > 1) whose head is the one-launch
advance_step kernel (kernels/ops/advance_step.py), its input ids read from a static buffer the
host fills with a device copy of the last step's tokens; eagerly (CPU, batches past the graphs)
the inputs are rebuilt with torch ops. The burst's tokens, [steps, S], come back in one device ->
host copy. Scheduling, input staging and the step's host post-processing are
paid once per burst instead of once per token, so a model whose decode step is shorter than the
engine's host work per step (small models, or any model on a slow host) is no longer paced by
the host.

A burst is taken only when nothing needs the host between its steps (`burst_steps`):
  - every scheduled sequence decodes one token, and nothing waits that could be admitted
    (a waiting request would otherwise sit out the whole burst before its prefill);
  - no sequence asks for logprobs, prompt_logprobs, penalties or logit_bias (their tensors are
    built on the host from the tokens so far);
  - no sequence would run past max_tokens or max_model_len within the burst (the burst is
    shortened to the tightest one instead);
  - every sequence's lookahead blocks (room for the burst's tokens) come from the free list, with
    no preemption; else the round runs one step.
Stop tokens, EOS and stop strings are checked on the host afterwards, token by token: a sequence
that stops inside a burst keeps the tokens up to its stop and drops the rest (their K/V were
written to its own blocks, freed with it), so outputs equal those of single steps; only the
timing differs (a burst's tokens reach the caller together). Sampling draws each step's noise
exactly as a single step would, so seeded requests give the same tokens. Prefix-cache blocks are
registered only over tokens known on the host (BlockManager.register_full_blocks' num_known), since
a burst in flight leaves several placeholders. Off under tensor parallelism (the workers replay one
step per message). Measured on CPU only so far (scripts/host_overhead.py --num-scheduler-steps);
the GPU tests (test_multi_step.py, test_advance_step.py) and `scripts/gpu.sh msprobe` are written.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from dsquant.runtime.engine.sampler import sample
from dsquant.runtime.kernels.ops.advance_step import advance_step, cache_slots
from dsquant.runtime.engine.scheduler import ScheduledBatch, Scheduler


def burst_steps(batch: ScheduledBatch, scheduler: Scheduler, max_steps: int, max_model_len: int) -> int:
    """How many decode steps `batch` runs in one launch (the rules above); allocates the lookahead
    blocks of a burst (steps > 1). 1: a normal step."""
    if max_steps <= 1 or not batch.seqs:
        return 1
    if scheduler.waiting and len(scheduler.running) < scheduler.config.max_num_seqs:
        return 1
    steps = max_steps
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        if n != 1 or seq.num_uncomputed_tokens != 1:
            return 1
        if seq.logprobs is not None or seq.prompt_logprobs is not None or seq.params.has_penalties:
            return 1
        # tokens seq may still take: the burst's last must not pass max_tokens or max_model_len
        left = min(seq.params.max_tokens - seq.num_completion_tokens, max_model_len - seq.num_tokens)
        steps = min(steps, left)
        if steps <= 1:
            return 1
    bm = scheduler.block_manager
    if sum(bm.blocks_needed(seq, steps) for seq in batch.seqs) > bm.num_free_blocks:
        return 1
    for seq in batch.seqs:
        bm.allocate(seq, steps)  # room for the K/V of the burst's inputs
    return steps


def run_burst(runner, inputs, first: torch.Tensor, steps: int) -> torch.Tensor:
    """Queue steps 2..steps of a burst whose first step sampled `first` [S] from `inputs` (a
    ModelRunner's StepInputs, staged in the decode graphs or eager) -> every step's tokens
    [steps * S] int64, step-major, on the device."""
    n = first.shape[0]
    burst = torch.empty(steps, n, dtype=torch.int64, device=first.device)  # [steps, S]
    burst[0].copy_(first)  # a copy: a graph's greedy buffer is rewritten by its next replay
    graphs = runner.graphs if inputs.graph else None
    for j in range(1, steps):
        if graphs is not None:  # the burst graph advances its static inputs itself
            graphs.prev[:n].copy_(burst[j - 1])
            logits, greedy = graphs.replay_burst(n)
            tokens = sample(logits, inputs.sampling, runner.generator, inputs.penalties, greedy=greedy)
        else:
            advance_eager_inputs(runner, inputs, burst[j - 1])
            tokens = runner._forward_sample(inputs)[0]
        burst[j].copy_(tokens)
    return burst.view(-1)


def advance_static_inputs(graphs, size: int, block_size: int) -> None:
    """The decode graphs' static inputs of a bucket of `size` rows, one step on (captured at the head of
    the burst graphs): input ids from graphs.prev; positions and seq_lens + 1 and the new position's
    slot from the static block table, on live rows only (padding rows, slot -1, stay inert)."""
    g = graphs
    advance_step(g.prev[:size], g.input_ids[:size], g.positions[:size], g.seq_lens[:size], g.slot_mapping[:size],
                 g.block_tables[:size], block_size)


def advance_eager_inputs(runner, inputs, tokens: torch.Tensor) -> None:
    """An eager step's StepInputs, one decode step on (every row one token and sampled)."""
    ctx, bs = inputs.ctx, runner.config.block_size
    positions = inputs.positions + 1  # [S]
    cos, sin = runner.model.rope_cos_sin(positions[None])  # [1, S, rot/2]
    inputs.ctx = replace(ctx, cos=cos, sin=sin, slot_mapping=cache_slots(ctx.block_tables, positions, bs),
                         seq_lens=ctx.seq_lens + 1, max_seq_len=ctx.max_seq_len + 1,
                         seq_lens_host=[n + 1 for n in ctx.seq_lens_host])
    inputs.input_ids, inputs.positions = tokens, positions

