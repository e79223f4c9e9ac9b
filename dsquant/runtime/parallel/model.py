"""Build this rank's shard of a CausalLM directly, and a reader that serves its tensors.

`tensor_parallel_backends` gives the Backends a rank builds its model with (runtime/loader.py), so
the model is rank-local from construction and nothing changes it afterwards:
  local         this rank's range of attention heads, GQA kv heads and routed experts; the model
                builds only those (other ranks' experts are None in MoE.experts, so checkpoint
                names keep their global expert ids) and `model.config` is the rank's view (heads
                per rank, which sizes the KV cache: GQA local kv heads; MLA unchanged)
  linear        given the checkpoint's full shapes, returns this rank's shard (parallel/linear.py):
    attention   GQA q_proj (and k/v_proj over kv heads) column-parallel, o_proj row-parallel; MLA
                q_proj / q_b_proj and kv_b_proj column-parallel by heads (rows are head-major:
                [H, nope + rope] and [H, nope + v]), o_proj row-parallel, q_a_proj /
                kv_a_proj_with_mqa replicated (each rank caches the full latent)
    dense MLP   gate / up column-parallel, down row-parallel; shared experts the same (their
                partial sum joins the routed one); routed experts and the router replicated
    lm_head     column-parallel over the vocabulary
  embedding     VocabParallelEmbedding: rows [vocab part]; ids elsewhere give zeros; all-reduce
  moe           moe.ExpertParallel over the backend: each rank sums its own experts' outputs
  all_reduce    each decoder layer sums its attention and MLP partial sums over the ranks
  gather_logits lm_head's [..., vocab / N] gathered to rank 0
The shard plan (`TensorParallelPlan`) records, as each linear is built, the rules that cut its
checkpoint tensors; `plan.reader()` is the CheckpointReader the loader then reads them through.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from dsquant.errors import ConfigError
from dsquant.models.layers import Backends
from dsquant.models.loader import WeightSource
from dsquant.models.moe import LoopMoE
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


COLUMN_PARALLEL = ("q_proj", "q_b_proj", "kv_b_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
ROW_PARALLEL = ("o_proj", "down_proj")


def parallel_kind(prefix: str) -> str | None:
    """COLUMN, ROW or None (replicated) for the linear named `prefix` ("model.layers.3.mlp.down_proj")."""
    if ".mlp.experts." in prefix:
        return None  # routed experts are split across ranks whole (expert parallelism)
    name = prefix.rpartition(".")[2]
    return COLUMN if name in COLUMN_PARALLEL else ROW if name in ROW_PARALLEL else None


class TensorParallelPlan:
    """This rank's shard, gathered while the model is built: each linear's rules (checkpoint key
    -> this rank's tensor), and the keys of other ranks' experts, which this rank never reads."""

    def __init__(self, cfg, reader, state: ParallelState, linear):
        self.cfg, self.inner, self.state, self.full_linear = cfg, reader, state, linear
        self.rules: dict[str, Rule] = {}
        self.hidden: set[str] = set()
        full = WeightSource(reader, cfg)
        self.dense_weight = lambda key: full.dense_weight(key, torch.float32)
        mine = self.local(cfg.n_routed_experts) if cfg.n_routed_experts else range(0)
        for i in range(cfg.num_hidden_layers):
            if cfg.is_moe_layer(i):
                prefix = f"model.layers.{i}.mlp.experts."
                self.hidden |= {k for k in reader.layer_keys(i) if k.startswith(prefix)
                                and int(k[len(prefix):].split(".", 1)[0]) not in mine}

    def local(self, total: int) -> range:
        """This rank's range of `total` heads or experts (Backends.local)."""
        part = Part.of(total, self.state.rank, self.state.world_size)
        return range(part.start, part.stop)

    def parts(self, total: int) -> list[Part]:
        """Every rank's range of `total` elements (divisible by the heads: check_tensor_parallel)."""
        return [Part.of(total, r, self.state.world_size) for r in range(self.state.world_size)]

    def linear(self, prefix: str, in_features: int, out_features: int, bias: bool):
        """Backends.linear: the linear `prefix` of the checkpoint's shape, as this rank's shard."""
        layer = self.full_linear(prefix, in_features, out_features, bias)
        kind = parallel_kind(prefix)
        if kind is not None:
            parts = self.parts(out_features if kind == COLUMN else in_features)
            rules, hidden = shard_linear(layer, kind, parts, self.state, self.inner, self.dense_weight)
            self.rules.update(rules)
            self.hidden |= hidden
        return layer

    def embedding(self, vocab_size: int, hidden_size: int) -> VocabParallelEmbedding:
        """Backends.embedding: this rank's rows of the vocabulary."""
        part = Part.of(vocab_size, self.state.rank, self.state.world_size)
        key = "model.embed_tokens.weight"
        self.rules[key] = lambda: self.dense_weight(key)[part.slice].contiguous()
        return VocabParallelEmbedding(part, hidden_size, self.state)

    def reader(self) -> ShardedReader:
        """The reader this rank loads from, once the model is built."""
        return ShardedReader(self.inner, self.rules, self.hidden)


def tensor_parallel_backends(backends: Backends, cfg, reader, state: ParallelState) -> tuple[Backends, TensorParallelPlan]:
    """The Backends that build this rank's shard of the model (module docstring), and the plan
    whose reader() it loads from once built. `backends.linear` is the full-shape factory."""
    check_tensor_parallel(cfg, state.world_size, state.device)
    plan = TensorParallelPlan(cfg, reader, state, backends.linear)
    experts = plan.local(cfg.n_routed_experts or 1)
    moe = ExpertParallel(backends.moe or LoopMoE(), experts.start, experts.stop)
    width = -(-cfg.vocab_size // state.world_size)  # columns per rank (the last may hold fewer)
    return dataclasses.replace(
        backends, linear=plan.linear, embedding=plan.embedding, local=plan.local, moe=moe,
        all_reduce=partial(all_reduce, state=state),
        gather_logits=partial(gather_last_dim, state=state, width=width, total=cfg.vocab_size)), plan
