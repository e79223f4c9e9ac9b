"""The two-stage Triton argmax equals torch.argmax: first index on ties, first NaN wins."""
import pytest
import torch

from dsquant.runtime.kernels.ops.argmax import argmax


def _logits(rows: int, vocab: int, dtype, device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3  # [S, V]
    if rows > 1:  # exact ties: the maximum copied to a later index, in another chunk and in the same one
        m, i = x[1].max(0)
        x[1, torch.randint(0, vocab, (3,), generator=g)] = m
    if rows > 2:
        x[2] = 1.0  # the whole row tied
    if rows > 3:
        x[3] = float("-inf")
    return x.to(device=device, dtype=dtype)


def _check(x: torch.Tensor, block: int = 2048) -> None:
    out = torch.full((x.shape[0],), -7, dtype=torch.int64, device=x.device)  # poisoned
    got = argmax(x, block=block, out=out)
    want = x.argmax(dim=-1)
    assert got.dtype == torch.int64 and got.data_ptr() == out.data_ptr()
    assert torch.equal(got, want), f"{got.tolist()} != torch {want.tolist()}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("rows,vocab,block", [(1, 5000, 2048), (4, 4097, 2048), (5, 300, 16), (2, 7, 2048)])
def test_argmax_matches_torch_interpreter_or_gpu(rows, vocab, block, dtype, device):
    for seed in range(2):
        _check(_logits(rows, vocab, dtype, device, seed), block)


def test_nan_wins_like_torch(device):
    """torch.argmax treats NaN as the largest value (its first NaN is returned), also over +inf."""
    x = _logits(3, 700, torch.float32, device, 5)
    x[0, 650] = float("inf")
    x[0, 600] = float("nan")
    x[0, 690] = float("nan")
    x[1, 5] = float("nan")
    assert x.argmax(-1)[0].item() == 600
    _check(x, block=64)


def test_strided_rows_and_empty(device):
    x = _logits(4, 600, torch.float32, device, 6)
    _check(x[::2], block=128)  # rows two apart in memory
    assert argmax(x[:0]).shape == (0,)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_argmax_bf16_vocab_102400_gpu(rows):
    for seed in range(3):
        x = _logits(rows, 102400, torch.bfloat16, "cuda", seed)
        x[0, 102399] = x[0].max() + 1  # the last entry of the last (partial) chunk
        _check(x)
        if rows > 4:
            x[4, 50000] = float("nan")
            _check(x)
