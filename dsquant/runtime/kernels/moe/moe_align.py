"""Group the (token, expert) pairs of a routed batch by expert, padding each expert to BLOCK_M.

Input: topk_ids [T, top_k] (int32/int64 expert ids; ids outside [0, E) are dropped). Pair p is
the flattened index t * top_k + j. Outputs (fixed sizes, so the launch is CUDA-graph capturable):
- sorted_token_ids int32 [max_padded]: the pair indices of expert 0, padded to a multiple of
  BLOCK_M with the sentinel T*top_k, then expert 1's, ...; pairs keep their order inside an
  expert; the tail past num_tokens_post_padded holds the sentinel too.
- expert_ids int32 [max_padded / BLOCK_M]: the expert of each BLOCK_M-row block, -1 past the end.
- num_tokens_post_padded int32 [1]: rows in use (a multiple of BLOCK_M).
max_padded = T*top_k + min(E, T*top_k) * (BLOCK_M - 1), rounded up to BLOCK_M: at most that many
experts receive pairs, each wasting at most BLOCK_M - 1 rows.
Three implementations with identical outputs: "triton", one program doing it all (two passes over
the pairs, one-hot counts and in-chunk prefix sums), whose cost grows with T*top_k*E (25.5 us for
V2-Lite's 512 pairs of 66 experts on an H100, 2026-12-06, about 9% of a 64-sequence INT4 decode
step); "sort", one program that counts with tl.histogram and places every pair at once from a
bitonic tl.sort of (expert, pair) keys, up to SORT_MAX_PAIRS pairs; and "torch", a stable argsort
plus scatters (about a dozen launches, all capturable). "auto" takes "sort" up to
AUTO_SORT_MAX_PAIRS pairs and "torch" beyond: `bash scripts/gpu.sh alignq` on an H200 (2026-12-06,
CUDA-graph medians, us, triton / sort / torch): V2-Lite 8 pairs 2.46 / 2.14 / 63.1, 512 pairs
25.6 / 6.0 / 93.8, 2048 pairs 92.6 / 20.0 / 100.2; V3 (257 experts) 9 pairs 3.19 / 2.99 / 65.2,
576 pairs 53.4 / 19.0 / 98.4, 2304 pairs - / 82.0 / 106.8 (docs/bench/alignq-h200-2026-12-06.json).
`one_block_per_pair` is the launch-free alternative for one token (its pairs have distinct experts):
block b is pair b alone, expert_ids = topk_ids.flat, no sorted ids (moe_gemm's PAIR_BLOCKS).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsquant.runtime.kernels import pdl


@dataclass
class MoeAlignment:
    sorted_token_ids: torch.Tensor | None  # int32 [max_padded]; None: one block per pair
    expert_ids: torch.Tensor  # int32 [max_padded // block_m]; one block per pair: topk_ids.flat [P]
    num_tokens_post_padded: torch.Tensor | None  # int32 [1]; None: one block per pair
    block_m: int
    num_pairs: int  # T * top_k, also the padding sentinel

    @property
    def one_block_per_pair(self) -> bool:
        return self.sorted_token_ids is None


def one_block_per_pair(topk_ids: torch.Tensor, block_m: int) -> MoeAlignment:
    """topk_ids [T, top_k] (ids in [0, E), or negative: a block moe_gemm skips) -> the alignment where
    block b holds pair b alone: no launch, expert_ids a view of topk_ids. Exact for any batch, but a
    pair of an expert another pair also has reads that expert's weights again, so it suits one token
    (distinct experts)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, top_k], got {tuple(topk_ids.shape)}")
    flat = topk_ids.reshape(-1)
    return MoeAlignment(None, flat if flat.is_contiguous() else flat.contiguous(), None, block_m, flat.numel())


@triton.jit
def _lay_out_segments(counts, sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr, num_pairs, max_padded, max_blocks,
                      BLOCK_M: tl.constexpr, FILL: tl.constexpr, BLOCKS: tl.constexpr):
    """From the pairs per expert, counts [BLOCK_E] (0 past E): store num_tokens_post_padded, the sentinel
    in every row (FILL rows a pass) and each BLOCK_M block's expert (BLOCKS blocks a pass); return each
    expert's first row [BLOCK_E]. Ends with a barrier, so the fill lands before the caller's scatter."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [BLOCK_E]
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(num_post_pad_ptr, total)
    for start in range(0, max_padded, FILL):
        offs = start + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + offs, tl.zeros([FILL], dtype=tl.int32) + num_pairs, mask=offs < max_padded)
    for start in range(0, max_blocks, BLOCKS):
        b = start + tl.arange(0, BLOCKS)  # [BLOCKS] block index
        row0 = b * BLOCK_M
        expert = tl.sum((ends[None, :] <= row0[:, None]).to(tl.int32), axis=1)  # experts ending before
        tl.store(expert_ids_ptr + b, tl.where(row0 < total, expert, -1), mask=b < max_blocks)
    tl.debug_barrier()
    return ends - padded


@triton.jit
def _moe_align_kernel(topk_ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr,
                      num_pairs, num_experts, max_padded, max_blocks,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                      FILL: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr = False):
    """One program. CHUNK pairs a pass over topk_ids ([CHUNK, BLOCK_E] one-hot tiles), FILL rows a
    pass of the sentinel fill, BLOCKS block ids a pass of the expert_ids search; each sized by the
    host to what it covers, so a decode step (8 pairs, 128 rows) makes one pass of each."""
    pdl.enter(PDL)
    e = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)  # [CHUNK]
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    counts = tl.where(e < num_experts, counts, 0)
    starts = _lay_out_segments(counts, sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr, num_pairs, max_padded,
                               max_blocks, BLOCK_M, FILL, BLOCKS)
    seen = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        valid = (offs < num_pairs) & (ids >= 0) & (ids < num_experts)
        onehot = (ids[:, None] == e[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E]
        slot = tl.cumsum(onehot, axis=0) - 1 + seen[None, :] + starts[None, :]
        pos = tl.sum(onehot * slot, axis=1)  # [CHUNK]
        tl.store(sorted_ids_ptr + pos, offs, mask=valid)
        seen += tl.sum(onehot, axis=0)


@triton.jit
def _moe_align_sort_kernel(topk_ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr,
                           num_pairs, num_experts, max_padded, max_blocks,
                           BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, NP: tl.constexpr,
                           FILL: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr = False):
    """One program, the pairs in one [NP] tile (NP >= num_pairs, a power of two; BLOCK_E > num_experts).
    Counts by tl.histogram (dropped pairs in bin E), then keys bin * NP + pair sorted ascending: the
    i-th key's pair goes to row starts[e] + i - first[e], first[e] being how many pairs precede
    expert e's (pair order kept, as the keys break ties by pair index)."""
    pdl.enter(PDL)
    offs = tl.arange(0, NP)  # [NP]
    ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
    valid = (offs < num_pairs) & (ids >= 0) & (ids < num_experts)
    bins = tl.where(valid, ids, num_experts)  # [NP]
    e = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    counts = tl.where(e < num_experts, tl.histogram(bins, BLOCK_E), 0)
    first = tl.cumsum(counts, axis=0) - counts
    starts = _lay_out_segments(counts, sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr, num_pairs, max_padded,
                               max_blocks, BLOCK_M, FILL, BLOCKS)
    key = tl.sort(bins * NP + offs)  # [NP] by expert, then pair
    sbin = key // NP
    e_of = tl.minimum(sbin, BLOCK_E - 1)
    row = tl.gather(starts, e_of, 0) + offs - tl.gather(first, e_of, 0)
    tl.store(sorted_ids_ptr + row, key % NP, mask=sbin < num_experts)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


TRITON_MAX_PAIRS = 2048  # the most pairs scripts/moe_align_probe.py times the one-hot kernel at
SORT_MAX_PAIRS = 4096  # "sort" holds the pairs in one tile of up to this many
AUTO_SORT_MAX_PAIRS = 2304  # "auto": "sort" up to here (the largest pair count timed, V3 at 256 tokens), then "torch"


def _align_torch(flat, num_experts, block_m, sorted_ids, expert_ids, num_post):
    """The same outputs as _moe_align_kernel, in torch ops (stable sort keeps the pair order)."""
    n = flat.numel()
    valid = (flat >= 0) & (flat < num_experts)
    bins = torch.where(valid, flat, num_experts).long()  # [N], dropped pairs in bin E
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, bins, torch.ones_like(bins))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    ends = padded.cumsum(0)
    order = torch.sort(bins, stable=True)[1]  # [N] pair indices grouped by expert
    sorted_bins = bins[order]
    first = (counts.cumsum(0) - counts)  # [E] first sorted index of each expert
    keep = sorted_bins < num_experts
    e = sorted_bins.clamp(max=num_experts - 1)
    pos = (ends - padded)[e] + torch.arange(n, device=flat.device) - first[e]
    pos = torch.where(keep, pos, sorted_ids.shape[0])  # dropped pairs go to a spare slot
    buf = torch.full((sorted_ids.shape[0] + 1,), n, dtype=torch.int32, device=flat.device)
    buf.scatter_(0, pos, order.to(torch.int32))
    sorted_ids.copy_(buf[:-1])
    block_start = torch.arange(expert_ids.shape[0], device=flat.device) * block_m
    total = ends[-1]
    blocks = torch.searchsorted(ends, block_start, right=True)
    expert_ids.copy_(torch.where(block_start < total, blocks, -1).to(torch.int32))
    num_post.copy_(total.reshape(1).to(torch.int32))


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                         out: MoeAlignment | None = None, method: str = "auto") -> MoeAlignment:
    """topk_ids [T, top_k] -> MoeAlignment (see module docstring); `out` reuses its buffers."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, top_k], got {tuple(topk_ids.shape)}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    flat = topk_ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    num_pairs = flat.numel()
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    dev = topk_ids.device
    if out is not None:
        if out.sorted_token_ids.shape[0] != max_padded or out.block_m != block_m:
            raise ValueError(f"alignment buffers hold {out.sorted_token_ids.shape[0]} rows of block "
                             f"{out.block_m}, expected {max_padded} rows of block {block_m}")
        sorted_ids, expert_ids, num_post = out.sorted_token_ids, out.expert_ids, out.num_tokens_post_padded
    else:
        sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
        expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32, device=dev)
        num_post = torch.empty(1, dtype=torch.int32, device=dev)
    if method not in ("auto", "triton", "sort", "torch"):
        raise ValueError(f"moe_align method must be auto, triton, sort or torch, got {method!r}")
    if method == "sort" and num_pairs > SORT_MAX_PAIRS:
        raise ValueError(f"moe_align method 'sort' takes at most {SORT_MAX_PAIRS} pairs, got {num_pairs}")
    if method == "auto":
        method = "sort" if num_pairs <= AUTO_SORT_MAX_PAIRS else "torch"
    if method == "torch":
        _align_torch(flat, num_experts, block_m, sorted_ids, expert_ids, num_post)
        return MoeAlignment(sorted_ids, expert_ids, num_post, block_m, num_pairs)
    max_blocks = max_padded // block_m
    blocks_tile = lambda block_e: max(16, min(128, 8192 // block_e, triton.next_power_of_2(max_blocks)))  # noqa: E731
    fill = max(16, min(1024, triton.next_power_of_2(max_padded)))
    if method == "sort":
        block_e = max(16, triton.next_power_of_2(num_experts + 1))  # bin E holds the dropped pairs
        np_tile = max(16, triton.next_power_of_2(num_pairs))
        _moe_align_sort_kernel[(1,)](flat, sorted_ids, expert_ids, num_post, num_pairs, num_experts,
                                     max_padded, max_blocks, BLOCK_M=block_m, BLOCK_E=block_e, NP=np_tile,
                                     FILL=fill, BLOCKS=blocks_tile(block_e), num_warps=4 if np_tile <= 512 else 8,
                                     **pdl.launch(flat.device))
        return MoeAlignment(sorted_ids, expert_ids, num_post, block_m, num_pairs)
    block_e = max(16, triton.next_power_of_2(num_experts))
    chunk = max(16, min(128, 8192 // block_e, triton.next_power_of_2(num_pairs)))
    blocks = blocks_tile(block_e)
    small = chunk * block_e <= 2048 and blocks * block_e <= 2048  # a decode step's tiles: 4 warps are plenty
    _moe_align_kernel[(1,)](flat, sorted_ids, expert_ids, num_post, num_pairs, num_experts,
                            max_padded, max_blocks, BLOCK_M=block_m, BLOCK_E=block_e,
                            CHUNK=chunk, FILL=fill, BLOCKS=blocks, num_warps=4 if block_e <= 64 or small else 8,
                            **pdl.launch(flat.device))
    return MoeAlignment(sorted_ids, expert_ids, num_post, block_m, num_pairs)
