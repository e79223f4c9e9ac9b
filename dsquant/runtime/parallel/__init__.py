"""Tensor parallelism for serving: one process per rank over torch.distributed.

Rank 0 is the process that owns the engine (scheduler, block manager, sampler, server); ranks
1..N-1 are spawned workers (worker.py) that load their shard and run each step's forward when
rank 0 broadcasts its inputs. What is split (model.py):
  attention   heads: q / kv up-projections column-parallel, o_proj row-parallel; MLA's q_a / kv_a
              (the LoRA down-projections) replicated, so every rank holds the whole latent cache
              for its own heads
  dense MLP   gate / up column-parallel, down row-parallel
  MoE         routed experts split across ranks (expert parallel); shared experts TP-sharded
              like a dense MLP; the router replicated
  vocab       embedding and lm_head split along the vocabulary
Each attention / MLP output is a partial sum on every rank, combined by one all-reduce; logits are
gathered to rank 0. linear.py shards each weight format in its packed layout.
"""
