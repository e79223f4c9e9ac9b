"""Shape checks of AWQ gemm / GPTQ tensors against the parsed config, before any is decoded.

A checkpoint whose tensors disagree with its config (another group size, other in/out
features, a g_idx that is not a grouping of K) must be refused, not decoded into a wrong
weight: each check raises a CheckpointError naming the file, the tensor, the expected and the
found shape, and the config it was derived from. Used at load by the runtime loader (serve,
generate, validate), by the reference loader (models/loader.py) and by `dsquant inspect`
(models/verify.py), so every path refuses the same checkpoints. Layouts: awq_gemm.py, gptq.py.
"""
from __future__ import annotations

from typing import Callable

import torch

from dsquant.errors import CheckpointError
from dsquant.formats import awq_gemm, gptq

INT4_TENSORS = {"awq": awq_gemm.TENSORS, "gptq": gptq.TENSORS}


def expected_shapes(fmt: str, group: int, n: int, k: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape for a Linear of out_features N, in_features K, group size G (> 0)."""
    return (awq_gemm if fmt == "awq" else gptq).expected_shapes(group, n, k)


def check_int4_shapes(fmt: str, group_size: int, n: int, k: int, shapes: dict[str, tuple[int, ...]],
                      prefix: str, file_of: Callable[[str], str], source: str = "config.json") -> None:
    """Raise CheckpointError unless the module's tensors (`shapes`: name -> shape, g_idx optional)
    are what `fmt` with `group_size` (-1: per channel) stores for [N, K]."""
    group = k if group_size <= 0 else group_size
    what = f"{fmt} 4-bit, group_size {group_size} from {source}, in_features {k}, out_features {n}"
    lead = f"{prefix}.qweight"
    where = file_of(lead) if "qweight" in shapes else file_of(prefix)
    if n % 8 or (fmt == "gptq" and k % 8):
        raise CheckpointError(f"{where}: tensor {lead!r}: {fmt} packs 8 values per int32, but "
                              f"{'out_features ' + str(n) if n % 8 else 'in_features ' + str(k)} is not a "
                              f"multiple of 8 ({what})")
    if k % group:
        raise CheckpointError(f"{where}: tensor {lead!r}: group_size {group} (from {source}) does not divide "
                              f"in_features {k}; {fmt} needs in_features % group_size == 0")
    for name, exp in expected_shapes(fmt, group, n, k).items():
        if name not in shapes:
            if name == "g_idx":
                continue
            raise CheckpointError(f"{file_of(prefix)}: tensor {prefix + '.' + name!r} is missing; {what} needs "
                                  f"it with shape {exp}")
        found = tuple(shapes[name])
        if found != exp:
            key = f"{prefix}.{name}"
            raise CheckpointError(f"{file_of(key)}: tensor {key!r} has shape {found}, expected {exp} ({what})")


def check_g_idx(g_idx: torch.Tensor, k: int, group_size: int, key: str, where: str) -> None:
    """A GPTQ g_idx [K] must map every input channel to one of the K/G groups, G channels each
    (plain order, or an act-order permutation of it)."""
    group = k if group_size <= 0 else group_size
    ng = k // group
    g = g_idx.to(torch.long).reshape(-1)
    if g.numel() and (int(g.min()) < 0 or int(g.max()) >= ng):
        raise CheckpointError(f"{where}: tensor {key!r} holds group indices {int(g.min())}..{int(g.max())}, "
                              f"expected 0..{ng - 1} (in_features {k}, group_size {group})")
    counts = torch.bincount(g, minlength=ng)
    if not bool((counts == group).all()):
        bad = int(torch.nonzero(counts != group)[0])
        raise CheckpointError(f"{where}: tensor {key!r} puts {int(counts[bad])} input channels in group {bad}, "
                              f"expected group_size {group} in each of {ng} groups: not a grouping of "
                              "in_features that act-order (desc_act) can store")
