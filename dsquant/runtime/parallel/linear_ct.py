"""Column- and row-parallel shards of compressed-tensors linears, kept in their packed layouts
(the other formats: linear.py; Part, LinearShard and the cut helpers: shard_parts.py).

  ct_int4  weight_packed [N, K/8] (8 codes an int32 along K), weight_scale [N, G],
           weight_zero_point [N/8, G] (asymmetric only; 8 zero points an int32 along N),
           weight_shape [2]. N: start and size multiples of 8 (whole zero-point packs). K: start
           and size multiples of 8 (whole code packs), re-grouped to G' = gcd(G, start, size) as
           AWQ is (a multiple of 32); the channel strategy is one group of K, re-grouped alike.
           weight_g_idx [K] (actorder "group"): whole on every column shard; a row split takes only
           plain groups (act-order ones reach all over K: no shard).
  ct_fp8   weight [N, K]; weight_scale [N/128, K/128] (block: linear.py's block rule), [N, 1]
           (channel: rows follow N, every K split keeps them) or [1] (tensor: every split keeps it).
           A W8A8 row split whose activation groups span ranks: block scales become linear.py's
           RowShardFP8Method (x quantized over the global groups, weight_scale read as its
           weight_scale_inv); channel or tensor scales load dense (ActQuantDenseMethod).
weight_shape is rewritten to the shard's [N_local, K_local].
"""
from __future__ import annotations

from dataclasses import replace

import torch

from dsquant.formats.gptq import is_plain_g_idx
from dsquant.runtime.layers.compressed_tensors import CTFloat8Method, CTPackedInt4Method
from dsquant.runtime.parallel.shard_parts import COLUMN, LinearShard, block_index, cut, regroup


def ct_int4_shard(method: CTPackedInt4Method, p: str, kind: str, part, get, n: int, k: int):
    """LinearShard of a pack-quantized INT4 layer, or None when the split breaks its packs or groups."""
    keys = {a: f"{p}.{a}" for a in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                                    "weight_g_idx")}
    if part.start % 8 or part.size % 8:
        return None
    packs = slice(part.start // 8, part.stop // 8)
    if kind == COLUMN:
        rules = {keys["weight_packed"]: lambda: cut(get(keys["weight_packed"]), 0, part.slice),
                 keys["weight_scale"]: lambda: cut(get(keys["weight_scale"]), 0, part.slice),
                 keys["weight_shape"]: lambda: torch.tensor([part.size, k], dtype=torch.int64)}
        if not method.symmetric:
            rules[keys["weight_zero_point"]] = lambda: cut(get(keys["weight_zero_point"]), 0, packs)
        if method.g_idx:  # every rank keeps all input channels, and their groups
            rules[keys["weight_g_idx"]] = lambda: get(keys["weight_g_idx"])
        return LinearShard(replace(method), rules)
    group = method.group_size if method.group_size > 0 else k
    if method.g_idx and not is_plain_g_idx(get(keys["weight_g_idx"]), k // group):
        return None  # actorder "group": a rank's channels reach groups all over K
    regrouped = regroup(group, part)
    if regrouped is None:
        return None
    g2, groups = regrouped
    rules = {keys["weight_packed"]: lambda: cut(get(keys["weight_packed"]), 1, packs),
             keys["weight_scale"]: lambda: cut(get(keys["weight_scale"]), 1, groups),
             keys["weight_shape"]: lambda: torch.tensor([n, part.size], dtype=torch.int64)}
    if not method.symmetric:
        rules[keys["weight_zero_point"]] = lambda: cut(get(keys["weight_zero_point"]), 1, groups)
    if method.g_idx:  # plain groups: the rank's own runs
        rules[keys["weight_g_idx"]] = lambda: (torch.arange(part.size) // g2).to(torch.int32)
    return LinearShard(replace(method, group_size=g2), rules)


def ct_fp8_shard(method: CTFloat8Method, p: str, kind: str, part, get):
    """LinearShard of a float-quantized FP8 layer whose activation groups (W8A8) stay on one rank,
    or None (block scales straddled)."""
    w, s = f"{p}.weight", f"{p}.weight_scale"
    dim = 0 if kind == COLUMN else 1
    rules = {w: lambda: cut(get(w), dim, part.slice)}
    if method.strategy == "block":
        blocks = block_index(part, method.block)
        if blocks is None:
            return None
        rules[s] = lambda: cut(get(s), dim, blocks)
    elif method.strategy == "channel" and kind == COLUMN:
        rules[s] = lambda: cut(get(s), 0, part.slice)
    return LinearShard(replace(method), rules)
