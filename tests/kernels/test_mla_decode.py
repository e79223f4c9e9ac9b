"""Absorbed MLA decode over the paged latent cache equals float32 attention, and equals the
unabsorbed (per-head K/V expanded through W_UK/W_UV) attention once brought back through W_UV.

Covers ragged batches, block boundaries, context length 1 and many blocks, every block size, head
counts below / at / above one head block, split-KV merge, YaRN-style scale, and absorbed prefill
rows (chunked prefill with a cached prefix). Outputs poisoned with NaN before each launch.
"""
import math

import pytest
import torch

from dsquant.errors import DsquantError
from dsquant.runtime.kernels.attention.mla_decode import MLADecodeConfig, mla_decode_attention, prefill_rows
from dsquant.runtime.kernels.attention.reference_attention import gather_paged, make_block_table, mla_decode_reference


def _inputs(device, dtype, seq_lens, block_size, heads, rank, rope, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    table = make_block_table(seq_lens, block_size, num_blocks, gen).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q_nope = torch.randn(len(seq_lens), heads, rank, dtype=dtype, device=device) / math.sqrt(rank) * 4
    q_pe = torch.randn(len(seq_lens), heads, rope, dtype=dtype, device=device)
    cache = torch.randn(num_blocks, block_size, rank + rope, dtype=dtype, device=device)
    return q_nope, q_pe, cache, table, lens


def _check(device, dtype, seq_lens, block_size, heads, rank, rope, config, atol, outliers=False):
    q_nope, q_pe, cache, table, lens = _inputs(device, dtype, seq_lens, block_size, heads, rank, rope,
                                               seed=sum(seq_lens) + heads + block_size)
    if outliers:  # every 7th slot's latent and rope key 6x: scores that jump well past the running maximum
        cache.view(-1, cache.shape[-1])[5::7] *= 6.0
        atol *= 6.0  # outputs up to 6x larger, so 6x the rounding
    scale = 1.0 / math.sqrt(rank // 4 + rope)
    out = torch.full_like(q_nope, float("nan"))
    mla_decode_attention(q_nope, q_pe, cache, table, lens, scale, config=config, out=out)
    ref = mla_decode_reference(q_nope, q_pe, cache, table, lens, scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0)
    for o, r in zip(out.float(), ref):  # per row, so long contexts' small outputs are held to bf16 precision too
        assert (o - r).norm() <= 1e-2 * r.norm() + 1e-6


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("heads,block_h", [(4, 16), (20, 16)])
@pytest.mark.parametrize("splits", [1, 3])
def test_mla_decode_cpu(block_size, heads, block_h, splits, device):
    seq_lens = [1, 2 * block_size, 4 * block_size + 5]
    config = MLADecodeConfig(block_h=block_h, block_n=16, num_stages=1, num_splits=splits)
    _check(device, torch.float16, seq_lens, block_size, heads, 64, 16, config, atol=2e-3)


def test_mla_decode_register_cap_cpu(device):
    """MLADecodeConfig.max_regs reaches the launch as Triton's maxnreg (the interpreter ignores it)."""
    config = MLADecodeConfig(block_h=16, block_n=16, num_stages=1, num_splits=2, max_regs=168)
    _check(device, torch.float16, [1, 40, 77], 16, 4, 64, 16, config, atol=2e-3)


def test_mla_decode_long_context_many_splits(device):
    """128 splits over a 5000-token context: past 64 x LONG_SPLIT_TOKENS' worth of splits the kernel
    takes longer ones (here 80 tokens: cdiv(5000, 64) rounded to block_n), so fewer than 128 are live;
    every key is still read exactly once, beside a short sequence in the same launch."""
    config = MLADecodeConfig(block_h=16, block_n=16, num_stages=1, num_splits=128)
    _check(device, torch.float16, [5000, 70], 16, 4, 64, 16, config, atol=2e-3)


def test_mla_decode_graph_max_seq_len(device):
    """Under a CUDA graph max_seq_len is max_model_len: the splits it sizes for a long context must
    still cover short sequences, each spreading its own length over them (partial merge included)."""
    seq_lens = [1, 40, 100]
    q_nope, q_pe, cache, table, lens = _inputs(device, torch.float16, seq_lens, 16, 4, 64, 16, seed=3)
    out = torch.full_like(q_nope, float("nan"))
    mla_decode_attention(q_nope, q_pe, cache, table, lens, 0.1, max_seq_len=1 << 17, out=out,
                         config=MLADecodeConfig(block_n=16, num_stages=1))
    torch.testing.assert_close(out.float(), mla_decode_reference(q_nope, q_pe, cache, table, lens, 0.1),
                               atol=2e-3, rtol=0)


@pytest.mark.parametrize("tiles", [1, 2])
def test_mla_decode_fine_splits(tiles, device):
    """min_split_tiles below 4: a short context spreads over more splits of `tiles` x block_n tokens
    (under a graph-sized max_seq_len), beside a sequence of one token and one past a block edge;
    every key is still read once and the merge equals the reference."""
    seq_lens = [1, 70, 17, 200]
    q_nope, q_pe, cache, table, lens = _inputs(device, torch.float16, seq_lens, 16, 4, 64, 16, seed=11 + tiles)
    out = torch.full_like(q_nope, float("nan"))
    mla_decode_attention(q_nope, q_pe, cache, table, lens, 0.1, max_seq_len=1 << 17, out=out,
                         config=MLADecodeConfig(block_n=16, num_stages=1, min_split_tiles=tiles))
    torch.testing.assert_close(out.float(), mla_decode_reference(q_nope, q_pe, cache, table, lens, 0.1),
                               atol=2e-3, rtol=0)


def test_mla_absorbed_equals_unabsorbed(device):
    """out_latent @ W_UV == softmax([q W_UK-expanded K ; k_pe]) (W_UV c), with a YaRN mscale in the scale."""
    heads, rank, rope, nope, v_dim, block_size = 4, 64, 16, 32, 32, 16
    seq_lens = [40, 1]
    gen = torch.Generator().manual_seed(11)
    w_uk = torch.randn(heads, nope, rank, generator=gen) / math.sqrt(rank)  # c -> k_nope per head
    w_uv = torch.randn(heads, v_dim, rank, generator=gen) / math.sqrt(rank)  # c -> v per head
    q_nope = torch.randn(2, heads, nope, generator=gen)
    _, q_pe, cache, table, lens = _inputs(device, torch.float16, seq_lens, block_size, heads, rank, rope, seed=5)
    mscale = 0.1 * math.log(40.0) + 1.0
    scale = mscale * mscale / math.sqrt(nope + rope)
    absorbed = torch.einsum("bhn,hnr->bhr", q_nope, w_uk).to(device, torch.float16)  # [B, H, R]
    out = torch.full_like(absorbed, float("nan"))
    mla_decode_attention(absorbed, q_pe, cache, table, lens, scale, out=out,
                         config=MLADecodeConfig(block_n=16, num_stages=1))
    got = torch.einsum("bhr,hvr->bhv", out.float().cpu(), w_uv)  # [B, H, v_dim]
    for b, n in enumerate(seq_lens):
        lat = gather_paged(cache, table[b], n).float().cpu()  # [L, R + P]
        k = torch.cat([torch.einsum("lr,hnr->hln", lat[:, :rank], w_uk),
                       lat[None, :, rank:].expand(heads, n, rope)], -1)  # [H, L, nope + P]
        v = torch.einsum("lr,hvr->hlv", lat[:, :rank], w_uv)  # [H, L, v_dim]
        q = torch.cat([q_nope[b], q_pe[b].float().cpu()], -1)[:, None]  # [H, 1, nope + P]
        ref = torch.softmax(q @ k.transpose(1, 2) * scale, -1) @ v  # [H, 1, v_dim]
        torch.testing.assert_close(got[b], ref[:, 0], atol=3e-3, rtol=0)


def test_mla_prefill_rows_causal(device):
    """Chunked prefill: 2 sequences with cached prefixes (0 and 21 tokens) and 5 / 9 new tokens."""
    heads, rank, rope, block_size = 16, 64, 16, 16
    seq_lens, q_lens = [5, 30], [5, 9]
    _, _, cache, table, lens = _inputs(device, torch.float16, seq_lens, block_size, heads, rank, rope, seed=9)
    tq = sum(q_lens)
    q_nope = torch.randn(tq, heads, rank, dtype=torch.float16, device=device) / 2
    q_pe = torch.randn(tq, heads, rope, dtype=torch.float16, device=device)
    cu = torch.tensor([0, 5, 14], dtype=torch.int32, device=device)
    row_table, row_lens = prefill_rows(cu, lens, table, tq)
    assert row_lens.tolist() == [1, 2, 3, 4, 5] + list(range(22, 31))
    out = torch.full_like(q_nope, float("nan"))
    mla_decode_attention(q_nope, q_pe, cache, row_table, row_lens, 0.125, out=out,
                         config=MLADecodeConfig(block_n=16, num_stages=1))
    for b, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        lat = gather_paged(cache, table[b], n).float()  # [L, R + P]
        rows = slice(int(cu[b]), int(cu[b + 1]))
        q = torch.cat([q_nope[rows], q_pe[rows]], -1).float()  # [ql, H, R + P]
        scores = torch.einsum("qhd,ld->hql", q, lat) * 0.125
        causal = torch.arange(n, device=device)[None] <= torch.arange(n - ql, n, device=device)[:, None]
        ref = torch.einsum("hql,lr->qhr", scores.masked_fill(~causal, float("-inf")).softmax(-1), lat[:, :rank])
        torch.testing.assert_close(out[rows].float(), ref, atol=2e-3, rtol=0)


def test_mla_rejects_non_power_of_two_rank(device):
    q = torch.randn(1, 16, 48, dtype=torch.float16, device=device)
    pe = torch.randn(1, 16, 16, dtype=torch.float16, device=device)
    cache = torch.randn(2, 16, 64, dtype=torch.float16, device=device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(DsquantError, match="kv_lora_rank"):
        mla_decode_attention(q, pe, cache, torch.zeros(1, 1, dtype=torch.int32, device=device), one, 0.1)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("heads", [16, 128])
def test_mla_decode_gpu(block_size, heads, device):
    seq_lens = [1, 64 * block_size, 4099, 33, 2 * block_size, 9000]
    _check(device, torch.bfloat16, seq_lens, block_size, heads, 512, 64, None, atol=1e-2)  # default_config


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 5])
def test_mla_decode_gpu_forced_splits(splits, device):
    _check(device, torch.bfloat16, [6000, 1, 16], 64, 128, 512, 64, MLADecodeConfig(num_splits=splits), atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("max_regs", [168, 128])
def test_mla_decode_gpu_register_cap(max_regs, device):
    """16 heads under a register cap (MLADecodeConfig.max_regs: more programs an SM, spills where it is tight)."""
    for block_n in (16, 32):
        _check(device, torch.bfloat16, [1, 4096, 4099, 33, 9000], 64, 16, 512, 64,
               MLADecodeConfig(block_n=block_n, max_regs=max_regs), atol=1e-2)


@pytest.mark.parametrize("heads,batch,length,expected", [
    (16, 1, 4096, 32), (16, 1, 32768, 256), (16, 1, 131072, 256), (16, 2, 131072, 128), (16, 4, 131072, 64),
    (16, 32, 4096, 8), (16, 32, 32768, 32), (16, 64, 4096, 8),
    (16, 64, 32768, 32), (128, 1, 4096, 32), (128, 32, 4096, 8), (128, 32, 32768, 8), (128, 64, 8192, 4),
    (16, 4, 100, 16), (16, 1, 776, 16), (16, 64, 776, 4),
])
def test_mla_split_choice(heads, batch, length, expected):
    """Split counts the heuristic picks on a 132-SM GPU: powers of two; for every bench shape but
    (128, 64, *) the pick is the fastest of the split counts measured with the default tiles in the 2026-11-29 H200 sweep.
    A few 16-head sequences get at least 16 whatever max_seq_len says (each sizes its own splits)."""
    from dsquant.runtime.kernels.attention.mla_decode_plan import choose_mla_splits, default_block_h

    block_h = default_block_h(heads)
    assert choose_mla_splits(batch * -(-heads // block_h), block_h, 32, length, 132) == expected
