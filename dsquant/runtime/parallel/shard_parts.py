"""This rank's part of a dimension and the shard rules a layer is loaded by, shared by the format
rules of linear.py (dense, AWQ, GPTQ, FP8 block) and linear_ct.py (compressed-tensors)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

Rule = Callable[[], torch.Tensor]
COLUMN, ROW = "column", "row"
INT4_GRANULE = 32  # smallest group the W4A16 kernel takes


@dataclass(frozen=True)
class Part:
    """This rank's range [start, stop) of one dimension."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def slice(self) -> slice:
        return slice(self.start, self.stop)

    @staticmethod
    def of(total: int, rank: int, world: int) -> "Part":
        """Even split, the last rank short when world does not divide total."""
        per = -(-total // world)
        start = min(total, rank * per)
        return Part(start, min(total, start + per))


@dataclass
class LinearShard:
    method: object  # the LinearMethod of the local layer
    rules: dict[str, Rule]  # checkpoint key -> this rank's tensor


def cut(t: torch.Tensor, dim: int, index) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) of t by slice or index list; contiguous."""
    if isinstance(index, list):
        return t.index_select(dim, torch.tensor(index, dtype=torch.long)).contiguous()
    return (t[index] if dim == 0 else t[:, index]).contiguous()


def regroup(group: int, part: Part) -> tuple[int, list[int]] | None:
    """Local group size G' and, per local group, the checkpoint group it lies in (None: cannot)."""
    g2 = math.gcd(group, part.start, part.size)
    if g2 % INT4_GRANULE:
        return None
    return g2, [(part.start + j) // group for j in range(0, part.size, g2)]


def block_index(part: Part, block: int) -> list[int] | None:
    """Per local B-block, the checkpoint block it lies in (None if one straddles two)."""
    index = []
    for j in range(0, part.size, block):
        first, last = part.start + j, min(part.start + j + block, part.stop) - 1
        if first // block != last // block:
            return None
        index.append(first // block)
    return index
