"""Column- and row-parallel shards of a QuantLinear, each format kept in its packed layout.

A Linear y = x W^T + b with W [N, K]:
  column-parallel  this rank keeps output features N[start:stop]; its y is that slice of y
  row-parallel     this rank keeps input features K[start:stop]; y = sum over ranks of
                   x_r W_r^T (the caller all-reduces); the bias stays on rank 0, zeros elsewhere
Layouts (design.md "Artifact formats"), group G, FP8 block B = 128:
  dense      weight [N, K]: rows / columns sliced
  awq        qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]. N: start and size multiples of 8
             (8 nibbles per int32 along N). K: re-grouped to G' = gcd(G, start, size), which must be
             a multiple of 32 (the W4A16 kernel's granule); each local group of G' rows lies inside
             one checkpoint group, whose qzeros / scales row it repeats.
  gptq       qweight [K/8, N], qzeros [K/G, N/8], scales [K/G, N], g_idx [K]. N as awq. K: start
             and size multiples of 8 and a plain g_idx (not act-order), re-grouped as awq.
  fp8_block  weight [N, K], weight_scale_inv [ceil(N/B), ceil(K/B)]: any slice whose local
             B-blocks each lie inside one checkpoint block (always so at multiples of B; also a
             slice inside a single block, e.g. 64 of a 128-row block), the scale rows / columns
             indexed accordingly. W8A8 activations are quantized per token per B input channels:
             a K split off those groups quantizes over the global groups (RowShardFP8Method).
  ct_int4, ct_fp8  compressed-tensors: linear_ct.py.
Any other split (act-order GPTQ along K, misaligned packs) loads the layer dense: the slice of its
dequantized weight, exact but uncompressed (logged).
The shard is described as rules: checkpoint key -> function giving this rank's tensor, read by
model.ShardedReader when the loader asks for the key.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from dsquant.formats import fp8_block
from dsquant.formats.gptq import is_plain_g_idx
from dsquant.models.checkpoint import layer_of
from dsquant.runtime.layers.linear import QuantLinear
from dsquant.runtime.layers.quant import AWQMethod, DenseMethod, FP8BlockMethod, GPTQMethod, LinearMethod
from dsquant.runtime.parallel.linear_ct import ct_fp8_shard, ct_int4_shard
# COLUMN, ROW, Part and Rule are also this module's names for model.py and the tests
from dsquant.runtime.parallel.shard_parts import (COLUMN, ROW, LinearShard, Part, Rule,  # noqa: F401
                                                  block_index, cut, regroup)
from dsquant.runtime.parallel.state import all_reduce_max

log = logging.getLogger(__name__)

def _awq(method: AWQMethod, p: str, kind: str, part: Part, get) -> LinearShard | None:
    keys = {a: f"{p}.{a}" for a in ("qweight", "qzeros", "scales")}
    if kind == COLUMN:
        if part.start % 8 or part.size % 8:
            return None
        packed = slice(part.start // 8, part.stop // 8)
        return LinearShard(replace(method), {
            keys["qweight"]: lambda: cut(get(keys["qweight"]), 1, packed),
            keys["qzeros"]: lambda: cut(get(keys["qzeros"]), 1, packed),
            keys["scales"]: lambda: cut(get(keys["scales"]), 1, part.slice)})
    regrouped = regroup(method.group_size, part)
    if regrouped is None:
        return None
    g2, groups = regrouped
    return LinearShard(replace(method, group_size=g2), {
        keys["qweight"]: lambda: cut(get(keys["qweight"]), 0, part.slice),
        keys["qzeros"]: lambda: cut(get(keys["qzeros"]), 0, groups),
        keys["scales"]: lambda: cut(get(keys["scales"]), 0, groups)})


def _gptq(method: GPTQMethod, p: str, kind: str, part: Part, get, k: int) -> LinearShard | None:
    keys = {a: f"{p}.{a}" for a in ("qweight", "qzeros", "scales", "g_idx")}
    if kind == COLUMN:
        if part.start % 8 or part.size % 8:
            return None
        packed = slice(part.start // 8, part.stop // 8)
        return LinearShard(replace(method), {
            keys["qweight"]: lambda: cut(get(keys["qweight"]), 1, part.slice),
            keys["qzeros"]: lambda: cut(get(keys["qzeros"]), 1, packed),
            keys["scales"]: lambda: cut(get(keys["scales"]), 1, part.slice),
            keys["g_idx"]: lambda: get(keys["g_idx"])})
    group = method.group_size if method.group_size > 0 else k
    if part.start % 8 or part.size % 8 or not is_plain_g_idx(get(keys["g_idx"]), k // group):
        return None  # act-order: a rank's channels reach groups all over K
    regrouped = regroup(group, part)
    if regrouped is None:
        return None
    g2, groups = regrouped
    local_g_idx = (torch.arange(part.size) // g2).to(torch.int32)
    return LinearShard(replace(method, group_size=g2), {
        keys["qweight"]: lambda: cut(get(keys["qweight"]), 0, slice(part.start // 8, part.stop // 8)),
        keys["qzeros"]: lambda: cut(get(keys["qzeros"]), 0, groups),
        keys["scales"]: lambda: cut(get(keys["scales"]), 0, groups),
        keys["g_idx"]: lambda: local_g_idx})


@dataclass
class RowShardFP8Method(FP8BlockMethod):
    """FP8 block weights on input channels [k_start, k_start + K_local) of k_total, where the
    rank's channels do not form whole 128-channel activation groups: x is quantized per token
    over the global groups (their amax all-reduced with MAX), then multiplied weight-only, so
    the product equals the unsplit W8A8 layer's."""

    k_start: int = 0
    k_total: int = 0
    state: object = field(default=None, repr=False, compare=False)

    def apply(self, layer, x):
        if not self.dynamic_activations:
            return super().apply(layer, x)
        x = sharded_activation_roundtrip(x, self.k_start, self.k_total, self.state, self.block)
        if not self.use_kernels(x):
            return LinearMethod.apply(self, layer, x)
        from dsquant.runtime.kernels.gemm.fp8_gemm import fp8_block_linear

        y = fp8_block_linear(x, layer.weight, layer.weight_scale_inv, weight_only=True,
                             splitk_counters=getattr(layer, "splitk_counters", None))  # [..., N]
        return y if layer.bias is None else y + layer.bias


def sharded_activation_roundtrip(x: torch.Tensor, k_start: int, k_total: int, state, group: int) -> torch.Tensor:
    """fp8_block.fp8_activation_roundtrip of the full [..., k_total] activation, restricted to this
    rank's channels x [..., K_local]; bit for bit the same values."""
    k = x.shape[-1]
    flat = x.reshape(-1, k).to(torch.float32)  # [M, K_local]
    m, lead, first = flat.shape[0], k_start % group, k_start // group
    spanned = -(-(lead + k) // group)  # global groups this rank's channels touch
    padded = torch.zeros(m, spanned * group, dtype=torch.float32, device=x.device)
    padded[:, lead:lead + k] = flat.abs()
    amax = torch.zeros(m, -(-k_total // group), dtype=torch.float32, device=x.device)  # [M, groups]
    amax[:, first:first + spanned] = padded.view(m, spanned, group).amax(-1)
    all_reduce_max(amax, state)
    g = (k_start + torch.arange(k, device=x.device)) // group  # [K_local] global group of each channel
    scale = (amax.clamp(min=fp8_block.FP8_ACT_SCALE_EPS) / fp8_block.FP8_E4M3_MAX)[:, g]  # [M, K_local]
    q = (flat / scale).clamp(-fp8_block.FP8_E4M3_MAX, fp8_block.FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * scale).to(x.dtype).reshape(x.shape)


def _fp8(method: FP8BlockMethod, p: str, kind: str, part: Part, get, sharded_acts: bool,
         scale_key: str = "weight_scale_inv") -> LinearShard | None:
    """scale_key: the checkpoint's name of the block scales (compressed-tensors: weight_scale), read
    under the fp8_block method's weight_scale_inv."""
    blocks = block_index(part, method.block)
    if blocks is None:
        return None
    dim = 0 if kind == COLUMN else 1
    w, s, src = f"{p}.weight", f"{p}.weight_scale_inv", f"{p}.{scale_key}"
    if sharded_acts:
        local = RowShardFP8Method(block=method.block, k_start=part.start, k_total=0)  # k_total, state: below
    else:
        local = FP8BlockMethod(block=method.block, dynamic_activations=method.dynamic_activations)
    return LinearShard(local, {w: lambda: cut(get(w), dim, part.slice), s: lambda: cut(get(src), dim, blocks)})


@dataclass
class ActQuantDenseMethod(DenseMethod):
    """A W8A8 layer loaded dense (its split fits no FP8 layout): the weight is the dequantized
    slice, and x is still quantized per token per 128 channels of the full K, so the product is
    the unsplit layer's."""

    k_start: int = 0
    k_total: int = 0
    sharded: bool = False  # row-parallel: groups may span ranks (an all-reduce of their amax)
    state: object = field(default=None, repr=False, compare=False)

    def apply(self, layer, x):
        if self.sharded:
            x = sharded_activation_roundtrip(x, self.k_start, self.k_total, self.state, fp8_block.FP8_BLOCK)
        else:
            x = fp8_block.fp8_activation_roundtrip(x)
        return super().apply(layer, x)


def _dense(p: str, kind: str, part: Part, dense_weight) -> LinearShard:
    dim = 0 if kind == COLUMN else 1
    return LinearShard(DenseMethod(), {f"{p}.weight": lambda: cut(dense_weight(f"{p}.weight"), dim, part.slice)})


def _whole_groups(part: Part, total: int, group: int = fp8_block.FP8_BLOCK) -> bool:
    return part.start % group == 0 and (part.size % group == 0 or part.stop == total)


def shard_linear(layer: QuantLinear, kind: str, parts: list[Part], state, reader,
                 dense_weight) -> tuple[dict[str, Rule], set[str]]:
    """Make `layer` this rank's shard (meta parameters of the local shape, the local method).

    parts: every rank's range (N for column, K for row); the layout is chosen from all of them,
    so every rank makes the same choice (a W8A8 row split that needs the amax all-reduce, or a
    dense fallback, happens on all ranks or none). reader: the full CheckpointReader;
    dense_weight(key) -> the full float [N, K] weight of a module of any stored format.
    Returns (rules, hidden): checkpoint key -> this rank's tensor, and the checkpoint keys this
    rank no longer reads (the packed tensors of a layer loaded dense).
    """
    p, k, n, m = layer.prefix, layer.in_features, layer.out_features, layer.method
    part = parts[state.rank]
    own_keys = [key for key in reader.layer_keys(layer_of(f"{p}.weight")) if key.rpartition(".")[0] == p]
    dynamic = m.dynamic_activations
    sharded_acts = kind == ROW and dynamic and not all(_whole_groups(q, k) for q in parts)

    def plan(q: Part) -> LinearShard | None:
        if m.name == "awq":
            return _awq(m, p, kind, q, reader.get)
        if m.name == "gptq":
            return _gptq(m, p, kind, q, reader.get, k)
        if m.name == "fp8_block":
            return _fp8(m, p, kind, q, reader.get, sharded_acts)
        if m.name == "ct_int4":
            return ct_int4_shard(m, p, kind, q, reader.get, n, k)
        if m.name == "ct_fp8" and sharded_acts:  # the global-group activation quant of fp8_block's row shard
            return _fp8(FP8BlockMethod(block=m.block), p, kind, q, reader.get, True,
                        "weight_scale") if m.strategy == "block" else None
        if m.name == "ct_fp8":
            return ct_fp8_shard(m, p, kind, q, reader.get)
        return None

    shards = [plan(q) for q in parts]
    shard = shards[state.rank]
    if any(s is None for s in shards):
        if m.name != "dense":
            log.info("%s: a %s split of %s into %s does not fit its %s layout; loading it dense", p, kind,
                     "N" if kind == COLUMN else "K", [(q.start, q.stop) for q in parts], m.name)
        shard = _dense(p, kind, part, dense_weight) if own_keys else LinearShard(DenseMethod(), {})
        if dynamic:
            shard.method = ActQuantDenseMethod(k_start=part.start if kind == ROW else 0, sharded=sharded_acts)
    if isinstance(shard.method, (RowShardFP8Method, ActQuantDenseMethod)):
        shard.method.k_total, shard.method.state = k, state
    k_local, n_local = (k, part.size) if kind == COLUMN else (part.size, n)
    bias = layer.bias is not None
    shard.method.kernels = m.kernels
    layer._parameters.clear()
    layer.method, layer.in_features, layer.out_features = shard.method, k_local, n_local
    shard.method.create_weights(layer, k_local, n_local)
    if bias:
        layer.bias = torch.nn.Parameter(torch.empty(n_local, device="meta"), requires_grad=False)
        b = f"{p}.bias"
        if kind == COLUMN:
            shard.rules[b] = lambda: reader.get(b)[part.slice].contiguous()
        elif state.rank != 0:
            shard.rules[b] = lambda: torch.zeros_like(reader.get(b))
    return shard.rules, {key for key in own_keys if key not in shard.rules and not key.endswith(".bias")}
