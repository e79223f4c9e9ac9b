"""Turn a meta-device CausalLM into this rank's shard, and a reader that serves its tensors.

The model is built with `tensor_parallel_backends`: each decoder layer all-reduces the output of
its self_attn and mlp (partial sums on every rank), and CausalLM.logits gathers lm_head's output
(this rank's part of the vocabulary) to rank 0. `shard_model` runs after the model is built and
before it loads (runtime/loader.py):
  embed_tokens  VocabParallelEmbedding: rows [vocab part]; ids elsewhere give zeros; all-reduce
  attention     heads [h0, h1): GQA q_proj (and k/v_proj over kv heads) column-parallel, o_proj
                row-parallel; MLA q_proj / q_b_proj and kv_b_proj column-parallel by heads
                (rows are head-major: [H, nope + rope] and [H, nope + v]), o_proj row-parallel,
                q_a_proj / kv_a_proj_with_mqa replicated (each rank caches the full latent)
  dense MLP     gate / up column-parallel, down row-parallel
  MoE           router replicated; experts [e0, e1) kept (moe.ExpertParallel), others None;
                shared experts sharded like a dense MLP (their partial sum joins the routed one)
  lm_head       column-parallel over the vocabulary; logits gathered to rank 0
`model.config` becomes the rank's view (heads per rank), which sizes the KV cache (GQA: local kv
heads; MLA: unchanged).
"""
from __future__ import annotations

import dataclasses
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from dsquant.errors import ConfigError
from dsquant.models.causal_lm import CausalLM
from dsquant.models.layers import Backends
from dsquant.models.loader import WeightSource
from dsquant.models.moe import MoE
from dsquant.runtime.parallel.linear import COLUMN, ROW, Part, Rule, shard_linear
from dsquant.runtime.parallel.moe import ExpertParallel
from dsquant.runtime.parallel.state import ParallelState, all_reduce, gather_last_dim

FLAG = "--tensor-parallel-size"


def check_tensor_parallel(cfg, size: int, device: torch.device) -> None:
    """ConfigError unless `size` ranks can split this model on `device`."""
    if size < 1:
        raise ConfigError(f"{FLAG} {size}: expected a positive number of processes")
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise ConfigError(f"{FLAG} {size} exceeds the {torch.cuda.device_count()} CUDA GPUs present "
                          "(one process per GPU)")
    counts = {"num_attention_heads": cfg.num_attention_heads}
    if not cfg.is_deepseek:
        counts["num_key_value_heads"] = cfg.num_key_value_heads
    has_moe = any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        counts["intermediate_size"] = cfg.intermediate_size
    if has_moe:
        counts["n_routed_experts"] = cfg.n_routed_experts
        if cfg.n_shared_experts:
            counts["moe_intermediate_size * n_shared_experts"] = cfg.moe_intermediate_size * cfg.n_shared_experts
    for name, value in counts.items():
        if value % size:
            divisors = [d for d in range(1, value + 1) if value % d == 0 and d <= 64]
            raise ConfigError(f"{FLAG} {size} does not divide {name} {value} of config.json; "
                              f"expected one of {divisors}")


class ShardedReader:
    """A CheckpointReader whose keys give this rank's shard: rules override tensors (or add
    virtual ones, such as the dense weight of a layer loaded dense), hidden keys are gone."""

    def __init__(self, reader, rules: dict[str, Rule], hidden: set[str]):
        self.inner, self.rules, self.hidden, self.root = reader, rules, hidden, reader.root

    def __contains__(self, key: str) -> bool:
        return key in self.rules or (key in self.inner and key not in self.hidden)

    def keys(self) -> list[str]:
        return [k for k in self.inner.keys() if k not in self.hidden]

    def layer_keys(self, layer: int | None) -> list[str]:
        return [k for k in self.inner.layer_keys(layer) if k not in self.hidden]

    def file_of(self, key: str):
        return self.inner.file_of(key) if key in self.inner else self.root

    def get(self, key: str) -> torch.Tensor:
        return self.rules[key]() if key in self.rules else self.inner.get(key)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [part] of the vocabulary (weight [part.size, hidden]); all-reduced lookup."""

    def __init__(self, part: Part, hidden: int, state: ParallelState):
        super().__init__()
        self.part, self.state = part, state
        self.weight = nn.Parameter(torch.empty(part.size, hidden, device="meta"))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [B, T] -> [B, T, hidden]
        here = (ids >= self.part.start) & (ids < self.part.stop)
        out = F.embedding(torch.where(here, ids - self.part.start, torch.zeros_like(ids)), self.weight)
        return all_reduce(out.masked_fill(~here[..., None], 0), self.state)


class _Plan:
    """Rules and hidden keys gathered while sharding one model."""

    def __init__(self, model: CausalLM, reader, state: ParallelState):
        self.model, self.reader, self.state = model, reader, state
        self.rules: dict[str, Rule] = {}
        self.hidden: set[str] = set()
        full = WeightSource(reader, model.config)
        self.dense_weight = lambda key: full.dense_weight(key, torch.float32)

    def part(self, total: int) -> Part:
        return Part.of(total, self.state.rank, self.state.world_size)

    def parts(self, total: int, unit: int = 1) -> list[Part]:
        """Every rank's range of `total` units, in elements (unit: elements per head)."""
        return [Part(q.start * unit, q.stop * unit) for q in
                (Part.of(total, r, self.state.world_size) for r in range(self.state.world_size))]

    def linear(self, layer, kind: str, parts: list[Part]) -> None:
        rules, hidden = shard_linear(layer, kind, parts, self.state, self.reader, self.dense_weight)
        self.rules.update(rules)
        self.hidden |= hidden

    def mlp(self, mlp) -> None:
        inter = self.parts(mlp.gate_proj.out_features)
        self.linear(mlp.gate_proj, COLUMN, inter)
        self.linear(mlp.up_proj, COLUMN, inter)
        self.linear(mlp.down_proj, ROW, inter)

    def attention(self, attn, cfg) -> None:
        h = cfg.num_attention_heads
        attn.num_heads = self.part(h).size
        if cfg.is_deepseek:
            q_up = attn.q_proj if cfg.q_lora_rank is None else attn.q_b_proj
            self.linear(q_up, COLUMN, self.parts(h, cfg.qk_head_dim))
            self.linear(attn.kv_b_proj, COLUMN, self.parts(h, cfg.qk_nope_head_dim + cfg.v_head_dim))
            self.linear(attn.o_proj, ROW, self.parts(h, cfg.v_head_dim))
            return
        d, h_kv = attn.head_dim, cfg.num_key_value_heads
        attn.num_kv_heads = self.part(h_kv).size
        self.linear(attn.q_proj, COLUMN, self.parts(h, d))
        for proj in (attn.k_proj, attn.v_proj):
            self.linear(proj, COLUMN, self.parts(h_kv, d))
        self.linear(attn.o_proj, ROW, self.parts(h, d))

    def moe(self, moe: MoE, layer_idx: int) -> None:
        experts = self.part(len(moe.experts))
        for e in range(len(moe.experts)):
            if not experts.start <= e < experts.stop:
                moe.experts[e] = None
                prefix = f"model.layers.{layer_idx}.mlp.experts.{e}."
                self.hidden |= {k for k in self.reader.layer_keys(layer_idx) if k.startswith(prefix)}
        moe.backend = ExpertParallel(moe.backend, experts.start, experts.stop)
        if moe.shared_experts is not None:
            self.mlp(moe.shared_experts)


def tensor_parallel_backends(backends: Backends, cfg, state: ParallelState) -> Backends:
    """`backends` whose model sums the attention / MLP partial sums over the ranks and gathers the
    vocabulary-parallel logits (lm_head's [..., vocab / N] on each rank) to rank 0."""
    width = -(-cfg.vocab_size // state.world_size)  # columns per rank (the last may hold fewer)
    return dataclasses.replace(backends, all_reduce=partial(all_reduce, state=state),
                               gather_logits=partial(gather_last_dim, state=state, width=width,
                                                     total=cfg.vocab_size))


def shard_model(model: CausalLM, reader, state: ParallelState) -> ShardedReader:
    """Shard `model` (still on meta, built with tensor_parallel_backends) in place for state.rank;
    return the reader to load it from."""
    cfg = model.config
    check_tensor_parallel(cfg, state.world_size, state.device)
    plan = _Plan(model, reader, state)
    for i, layer in enumerate(model.model.layers):
        plan.attention(layer.self_attn, cfg)
        if isinstance(layer.mlp, MoE):
            plan.moe(layer.mlp, i)
        else:
            plan.mlp(layer.mlp)

    vocab = plan.part(cfg.vocab_size)
    model.model.embed_tokens = VocabParallelEmbedding(vocab, cfg.hidden_size, state)
    embed = "model.embed_tokens.weight"
    plan.rules[embed] = lambda: plan.dense_weight(embed)[vocab.slice].contiguous()
    plan.linear(model.lm_head, COLUMN, plan.parts(cfg.vocab_size))

    local = dict(num_attention_heads=cfg.num_attention_heads // state.world_size)
    if not cfg.is_deepseek:
        local.update(num_key_value_heads=cfg.num_key_value_heads // state.world_size, head_dim=cfg.dense_head_dim)
    model.config = dataclasses.replace(cfg, **local)
    return ShardedReader(reader, plan.rules, plan.hidden)
