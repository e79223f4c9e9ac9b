"""moe_align kernel: every pair lands once in its expert's padded segment, in order; outputs poisoned."""
import pytest
import torch

from dsquant.runtime.kernels.moe.moe_align import MoeAlignment, max_padded_rows, moe_align_block_size


def _poisoned(num_pairs, num_experts, block_m, device):
    rows = max_padded_rows(num_pairs, num_experts, block_m)
    fill = lambda n: torch.full((n,), -7, dtype=torch.int32, device=device)  # noqa: E731
    return MoeAlignment(fill(rows), fill(rows // block_m), fill(1), block_m, num_pairs)


def _check(topk_ids, num_experts, block_m, device, method="triton"):
    flat = topk_ids.reshape(-1).cpu()
    n = flat.numel()
    a = moe_align_block_size(topk_ids, num_experts, block_m, out=_poisoned(n, num_experts, block_m, device),
                             method=method)
    sorted_ids, expert_ids = a.sorted_token_ids.cpu(), a.expert_ids.cpu()
    counts = torch.bincount(flat[(flat >= 0) & (flat < num_experts)], minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(padded.sum())
    assert int(a.num_tokens_post_padded) == total
    start = 0
    for e in range(num_experts):
        segment = sorted_ids[start:start + padded[e]]
        expected = torch.nonzero(flat == e).flatten().to(torch.int32)  # pair order kept
        assert torch.equal(segment[:counts[e]], expected), f"expert {e} holds the wrong pairs"
        assert (segment[counts[e]:] == n).all(), f"expert {e}: padding must be the sentinel {n}"
        assert (expert_ids[start // block_m:(start + padded[e]) // block_m] == e).all()
        start += int(padded[e])
    assert (sorted_ids[total:] == n).all() and (expert_ids[total // block_m:] == -1).all()


@pytest.mark.parametrize("t,top_k,num_experts,block_m", [
    (1, 6, 64, 16), (7, 2, 8, 16), (33, 6, 64, 32), (200, 8, 256, 64), (5, 3, 4, 1), (64, 6, 66, 16)])
@pytest.mark.parametrize("method", ["triton", "sort", "torch"])
def test_align_groups_pairs_by_expert(t, top_k, num_experts, block_m, method, device):
    ids = torch.stack([torch.randperm(num_experts, device=device)[:top_k] for _ in range(t)])
    _check(ids, num_experts, block_m, device, method)


@pytest.mark.parametrize("method", ["triton", "sort", "torch"])
def test_align_with_empty_experts_and_repeats(method, device):
    """Only experts 2 and 9 of 16 receive pairs (the rest none), some pairs share a token's expert."""
    ids = torch.tensor([[2, 9], [9, 2], [2, 9], [9, 9]], device=device)
    _check(ids, 16, 4, device, method)


@pytest.mark.parametrize("method", ["triton", "sort", "torch"])
def test_align_drops_out_of_range_ids(method, device):
    ids = torch.tensor([[0, -1], [5, 3]], device=device)
    _check(ids, 4, 4, device, method)


@pytest.mark.gpu
def test_align_full_size_both_methods(device):
    """V2-Lite at T=4096 (66 experts with the shared ones, 8 pairs a token) and V3 at T=512; "sort" (one
    tile of pairs) at V3's T = 512 and at V2-Lite's decode batch of 64 with some pairs dropped."""
    for t, e, k in ((4096, 66, 8), (512, 256, 8), (64, 66, 8)):
        ids = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(t)])
        for method in ("triton", "torch") + (("sort",) if t * k <= 4096 else ()):
            _check(ids, e, 64, device, method)


@pytest.mark.parametrize("t,top_k", [(8, 8), (288, 8), (289, 8)])  # 64, 2304 and 2312 pairs
def test_auto_takes_sort_then_torch(t, top_k, device, monkeypatch):
    """"auto" is "sort" up to AUTO_SORT_MAX_PAIRS pairs and "torch" beyond, with the same outputs."""
    import dsquant.runtime.kernels.moe.moe_align as ma

    calls, orig = [], ma._align_torch
    monkeypatch.setattr(ma, "_align_torch", lambda *a: (calls.append("torch"), orig(*a))[1])
    g = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(66, generator=g)[:top_k] for _ in range(t)]).to(device)
    got = moe_align_block_size(ids, 66, 16)
    assert calls == ([] if t * top_k <= ma.AUTO_SORT_MAX_PAIRS else ["torch"])
    want = moe_align_block_size(ids, 66, 16, method="torch")
    for a, b in ((got.sorted_token_ids, want.sorted_token_ids), (got.expert_ids, want.expert_ids),
                 (got.num_tokens_post_padded, want.num_tokens_post_padded)):
        assert torch.equal(a, b)


def test_align_rejects_bad_block(device):
    with pytest.raises(ValueError, match="power of two"):
        moe_align_block_size(torch.zeros(2, 2, dtype=torch.long, device=device), 4, 24)


def test_align_rejects_bad_method_and_too_many_pairs_for_sort(device):
    with pytest.raises(ValueError, match="method"):
        moe_align_block_size(torch.zeros(2, 2, dtype=torch.long, device=device), 4, 4, method="bitonic")
    with pytest.raises(ValueError, match="at most"):
        moe_align_block_size(torch.zeros(1025, 4, dtype=torch.long, device=device), 4, 4, method="sort")


@pytest.mark.parametrize("method", ["triton", "sort"])
def test_align_remote_pairs_and_a_power_of_two_expert_count(method, device):
    """64 experts (bin 64 of the sort holds the dropped pairs: BLOCK_E 128) with every third pair remote (-1)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(64, generator=g)[:8] for _ in range(24)])
    ids.view(-1)[::3] = -1
    _check(ids.to(device), 64, 16, device, method)
