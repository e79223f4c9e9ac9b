"""Weights that look like trained ones, for every kernel test.

Random weights with one standard deviation give every 128 x 128 FP8 block and every INT4 group
about the same scale, so a transposed, mis-strided or mis-padded scale matrix still passes (the
FP8 GPU path passed its tests and returned garbage on the trained model). The weights here have:
  - one random factor 10^U(-2, 1) per tile (tile = (128, 128) for FP8 blocks, (rows, group)
    for INT4 groups), so block and group scales spread over three orders of magnitude;
  - a few outlier input channels (columns) scaled by 50, as trained attention and MLP inputs have;
  - some all-zero output rows and one all-zero tile (a zero block / group: scale 0 or clamped).
`max_block_rel_err` compares per output block, so an error in a small-scale block is not hidden
by the norm of the large ones.
"""
from __future__ import annotations

import torch

FP8_TILE = (128, 128)
SPREAD = (-2.0, 1.0)  # log10 range of the per-tile factor
OUTLIER_GAIN = 50.0


def realistic_weight(*shape: int, seed: int, tile: tuple[int, int] = FP8_TILE, outliers: int = 3,
                     zero_rows: int = 2, zero_tiles: int = 1, device="cpu",
                     dtype: torch.dtype = torch.float32, draw_device=None) -> torch.Tensor:
    """A float weight [..., N, K] (leading dims: experts) with tile-wise scales spread over orders
    of magnitude, `outliers` input channels x 50, `zero_rows` zero rows and `zero_tiles` zero
    tiles per matrix. Deterministic in `seed`; drawn on the CPU, then moved. `draw_device`
    (e.g. "cuda") draws there instead: other values, as deterministic, and seconds rather than
    a minute for a full-size stack of experts (CPU random numbers are drawn on one thread)."""
    *lead, n, k = shape
    gdev = torch.device(draw_device or "cpu")
    gen = torch.Generator(device=gdev).manual_seed(seed)
    w = torch.randn(*lead, n, k, generator=gen, device=gdev) / k ** 0.5  # [..., N, K]
    tn, tk = min(tile[0], n), min(tile[1], k)
    nt, kt = -(-n // tn), -(-k // tk)
    lo, hi = SPREAD
    factor = 10 ** (lo + (hi - lo) * torch.rand(*lead, nt, kt, generator=gen, device=gdev))  # [..., nt, kt]
    w *= factor.repeat_interleave(tn, -2).repeat_interleave(tk, -1)[..., :n, :k]
    flat = w.reshape(-1, n, k)
    for mat in flat:  # per expert
        cols = torch.randperm(k, generator=gen, device=gdev)[: min(outliers, k)]
        mat[:, cols] *= OUTLIER_GAIN
        rows = torch.randperm(n, generator=gen, device=gdev)[: min(zero_rows, max(n - 1, 0))]
        mat[rows] = 0
        for _ in range(zero_tiles):
            r = int(torch.randint(nt, (1,), generator=gen, device=gdev)) * tn
            c = int(torch.randint(kt, (1,), generator=gen, device=gdev)) * tk
            mat[r:r + tn, c:c + tk] = 0
    return w.to(device=device, dtype=dtype)


def realistic_activations(m: int, k: int, *, seed: int, outliers: int = 2, device="cpu",
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] ~ N(0, 1) with `outliers` channels x 20 (trained models' activation outliers)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[: min(outliers, k)]] *= 20
    return x.to(device=device, dtype=dtype)


def max_block_rel_err(out: torch.Tensor, ref: torch.Tensor, block: int = 128) -> float:
    """Largest ||out - ref|| / ||ref|| over blocks of `block` output columns (last dim), in
    float64 on ref's device; a block whose reference is all zero must come out zero. NaN or Inf
    anywhere in `out` gives inf."""
    ref = ref.detach().double()
    out = out.detach().to(ref.device).double()
    if not torch.isfinite(out).all():
        return float("inf")
    n = ref.shape[-1]
    nb = -(-n // block)
    pad = nb * block - n
    err = torch.nn.functional.pad((out - ref).reshape(-1, n), (0, pad)).reshape(-1, nb, block)
    den = torch.nn.functional.pad(ref.reshape(-1, n), (0, pad)).reshape(-1, nb, block)
    e = err.pow(2).sum(dim=(0, 2)).sqrt()  # [nb]
    d = den.pow(2).sum(dim=(0, 2)).sqrt()  # [nb]
    ratio = torch.where(d > 0, e / d.clamp(min=1e-300), torch.where(e > 0, float("inf"), 0.0))
    return float(ratio.max())
