"""A step's small inputs go to the device in one host -> device copy.

The fields of a step (input ids, positions, slot mapping, logits rows, seq_lens, cu_seqlens,
block tables, sampling parameters: int64, int32 or fp32 lists) are written one after another into
an int64 host buffer, each starting on an 8-byte boundary, copied to the device in one transfer,
and handed out as 1-D views of the device buffer. On CUDA the host buffer is pinned and reused
across steps and the copy is non_blocking, so the host never waits for the GPU here; before the
buffer is rewritten the previous copy is waited for through an event (normally long done, since
each sampling step reads its tokens back). On CPU the host buffer is the device buffer: no copy.

A field written at a known offset can also land in a caller's device buffer (`out`): the decode
CUDA graphs keep their static inputs as views of one packed buffer laid out by `layout`.
"""
from __future__ import annotations

import numpy as np
import torch

NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def words(numel: int, dtype: torch.dtype) -> int:
    """int64 words a field of numel elements of dtype occupies."""
    return -(-numel * dtype.itemsize // 8)


def layout(fields: list[tuple[int, torch.dtype]]) -> tuple[list[int], int]:
    """Offsets in int64 words of fields (numel, dtype) placed back to back, and the total words."""
    offsets, total = [], 0
    for numel, dtype in fields:
        offsets.append(total)
        total += words(numel, dtype)
    return offsets, total


def views(buffer: torch.Tensor, fields: list[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
    """1-D views of buffer [N] int64 for fields (numel, dtype) laid out by `layout`."""
    sizes = [words(n, d) for n, d in fields]
    parts = buffer[:sum(sizes)].split(sizes)
    out = []
    for part, (n, dtype) in zip(parts, fields):
        if dtype != torch.int64:
            part = part.view(dtype)
            if part.shape[0] != n:  # an odd count of 4-byte values
                part = part[:n]
        out.append(part)
    return out


class PackedCopy:
    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self.host = torch.empty(0, dtype=torch.int64)  # [capacity]
        self.host_np = self.host.numpy()
        self.dev = self.host  # [capacity] on device (the host buffer itself on CPU)
        self.done = torch.cuda.Event() if self.pinned else None
        self.in_flight = False

    def _wait(self) -> None:
        if self.in_flight:
            self.done.synchronize()
            self.in_flight = False

    def _reserve(self, total: int) -> None:
        if total <= self.host.shape[0]:
            return
        size = max(total, 2 * self.host.shape[0], 4096)
        self.host = torch.empty(size, dtype=torch.int64, pin_memory=self.pinned)
        self.host_np = self.host.numpy()
        self.dev = torch.empty(size, dtype=torch.int64, device=self.device) if self.pinned else self.host

    def pack(self, fields: list[tuple[list, torch.dtype]], out: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Copy fields (values, dtype) to the device in one transfer; return their 1-D device views.

        out: an int64 device buffer to copy into (views of it are returned) instead of this one's."""
        spec = [(len(values), dtype) for values, dtype in fields]
        offsets, total = layout(spec)
        self._wait()  # the previous step's copy has read the host buffer
        self._reserve(total)
        buf = self.host_np
        for (values, dtype), offset, (n, _) in zip(fields, offsets, spec):
            if n:
                buf[offset:offset + words(n, dtype)].view(NUMPY[dtype])[:n] = values
        dst = self.dev if out is None else out
        if dst is not self.host:
            dst[:total].copy_(self.host[:total], non_blocking=True)
            if self.pinned:
                self.done.record()
                self.in_flight = True
        return views(dst, spec)
