"""advance_step (a multi-step burst's next inputs) equals its torch reference: live rows take the
sampled token, move one position on and get the slot of it from their block table; padding rows
(slot -1) keep every field. Random block tables (ids over the whole cache), positions that cross a
block boundary, several block sizes and row counts."""
import pytest
import torch

from dsquant.runtime.kernels.ops.advance_step import advance_step, advance_step_reference


def _buffers(rows: int, live: int, block_size: int, width: int, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    prev = torch.randint(0, 50000, (rows,), generator=g)
    ids = torch.randint(0, 50000, (rows,), generator=g)
    pos = torch.randint(0, (width - 1) * block_size, (rows,), generator=g)
    pos[0] = block_size - 1  # the next position starts a new block
    tables = torch.randint(0, 4096, (rows, width), generator=g, dtype=torch.int32)
    lens = (pos + 1).to(torch.int32)
    bt = tables.gather(1, (pos // block_size)[:, None])[:, 0].to(torch.int64)
    slots = bt * block_size + pos % block_size
    pad = torch.arange(rows) >= live  # padding rows as the graphs stage them
    slots[pad], lens[pad], pos[pad] = -1, 0, 0
    return [t.to(device) for t in (prev, ids, pos, lens, slots, tables)]


@pytest.mark.parametrize("rows,live,block_size,width", [(1, 1, 16, 4), (8, 5, 16, 9), (64, 64, 64, 3), (24, 17, 1, 40)])
def test_advance_step_matches_reference(rows, live, block_size, width, device):
    for seed in range(3):
        got = _buffers(rows, live, block_size, width, device, seed)
        want = [t.clone() for t in got]
        advance_step(*got, block_size, kernel=True)
        advance_step_reference(*want, block_size)
        for name, a, b in zip(("prev", "input_ids", "positions", "seq_lens", "slots", "tables"), got, want):
            assert torch.equal(a, b), name
        assert torch.equal(got[1][:live], got[0][:live]) and (got[4][live:] == -1).all()
