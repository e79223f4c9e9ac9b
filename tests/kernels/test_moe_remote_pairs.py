"""fused_moe with pairs that are not here (expert parallelism, runtime/parallel/moe.py): a negative
expert id with weight 0. Every path (the INT4 GEMVs, one block per pair, moe_align + the grouped GEMMs,
INT4 dequantized first) must read no weight for them and add nothing, so the result equals the float64
loop over the local pairs alone. Every buffer fused_moe allocates is poisoned with NaN (torch.empty
patched), so a piece left unwritten for a remote pair shows up if anything reads it."""
import pytest
import torch

from dsquant.runtime.kernels.moe import fused_moe as fm
from dsquant.runtime.kernels.moe.reference_moe import moe_experts_reference
from tests.kernels.moe_cases import check_close, hidden_states, make_experts, random_topk
from tests.kernels.test_moe_fused import _shape, _tol

E = 8


def _remote(tw, ids, keep):
    """Pairs whose expert is not in `keep` become id -1, weight 0 (what ExpertParallel passes)."""
    local = torch.isin(ids, torch.tensor(keep, device=ids.device))
    return tw * local, torch.where(local, ids, torch.full_like(ids, -1))


def _poison_empty(monkeypatch):
    real = torch.empty

    def empty(*a, **k):
        out = real(*a, **k)
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-(2 ** 20))

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("fmt,t,pairs_max", [("int4-g64", 1, 0), ("int4-g64", 5, 0), ("bf16", 2, 2),
                                             ("fp8", 1, 2), ("fp8", 6, 0), ("bf16", 6, 0)])
def test_remote_pairs_add_nothing(fmt, t, pairs_max, monkeypatch, device):
    """int4 T = 1: the pair kernels (GEMVs on fp32); T = 5: 15 pairs, gate/up on the pair kernel and down
    (past PAIR_MMA_DOWN_MAX_PAIRS on 16-bit activations) on the grouped GEMM one block per pair; bf16 / fp8
    up to 2 tokens: one block per pair; 6 tokens: moe_align and the grouped GEMMs."""
    monkeypatch.setattr(fm, "ONE_BLOCK_PER_PAIR_MAX_TOKENS", pairs_max)
    h, inter = _shape(fmt)
    weights, d13, d2 = make_experts(fmt, E, h, inter, torch.float16, device, seed=t + pairs_max)
    hidden = hidden_states(t, h, torch.float16, device, seed=t)
    tw, ids = random_topk(t, E, 3, device, seed=10 * t + pairs_max)  # seeded: local and remote pairs both drawn
    keep = [0, 2, 3, 5]  # this rank's experts (ids already renumbered)
    rtw, rids = _remote(tw, ids, keep)
    assert (rids < 0).any() and (rids >= 0).any()
    _poison_empty(monkeypatch)
    out = fm.fused_moe(hidden, weights, rtw, rids)
    pieces = fm.expert_outputs(hidden, weights, rids)  # [T, P, H]
    monkeypatch.undo()
    remote = rids < 0
    assert torch.isfinite(pieces[~remote]).all()
    if fmt.startswith("int4") and rids.numel() <= fm.PAIR_MMA_DOWN_MAX_PAIRS:
        assert (pieces[remote] == 0).all()  # the pair kernels ran for them with every weight load masked: zeros
    else:  # no block computed them (grouped GEMM): their rows stay as allocated (poisoned), and nothing reads them
        assert torch.isnan(pieces[remote]).all()
    ref = moe_experts_reference(hidden, d13, d2, rtw, torch.where(rids < 0, 0, rids), fp8_acts=fmt == "fp8")
    tol = _tol(fmt, hidden.dtype)
    check_close(out, ref, tol, block_tol=(3 if fmt == "fp8" else 2) * tol, what=fmt)


def test_remote_pairs_int4_dequantized_first(monkeypatch, device):
    """A prefill-sized INT4 batch (dequantized once, then the bf16 grouped GEMMs) with remote pairs."""
    monkeypatch.setattr(fm, "DEQUANT_MIN_PAIRS_PER_EXPERT", 1)
    weights, d13, d2 = make_experts("int4-g128", E, 128, 128, torch.float16, device, seed=4)
    hidden = hidden_states(6, 128, torch.float16, device, seed=4)
    rtw, rids = _remote(*random_topk(6, E, 3, device), keep=[1, 4, 6])
    _poison_empty(monkeypatch)
    out = fm.fused_moe(hidden, weights, rtw, rids)
    monkeypatch.undo()
    ref = moe_experts_reference(hidden, d13, d2, rtw, torch.where(rids < 0, 0, rids))
    check_close(out, ref, 4e-3)


def test_expert_parallel_passes_remote_pairs(monkeypatch):
    """ExpertParallel renumbers this rank's experts from 0 and gives the others id -1, weight 0."""
    from dsquant.runtime.parallel.moe import ExpertParallel

    seen = {}

    class Inner:
        def experts(self, module, x, ids, w):
            seen.update(ids=ids, w=w)
            return x

    ep = ExpertParallel(Inner(), 4, 8)
    ids = torch.tensor([[0, 4, 7], [5, 3, 6]])
    w = torch.tensor([[0.5, 0.25, 0.25], [0.6, 0.3, 0.1]])
    ep.experts(None, torch.zeros(2, 4), ids, w)
    assert torch.equal(seen["ids"], torch.tensor([[-1, 0, 3], [1, -1, 2]]))
    assert torch.equal(seen["w"], torch.tensor([[0.0, 0.25, 0.25], [0.6, 0.0, 0.1]]))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 64])
@pytest.mark.parametrize("fmt", ["int4-g128", "fp8", "bf16"])
def test_remote_pairs_v2_lite_bf16(fmt, t):
    """V2-Lite experts in bf16, rank 1 of 2 holding ids 33..65 (not renumbered here: the ids alone matter): every
    decode and grouped path with half the pairs remote, against the float64 loop over the rest."""
    from tests.kernels.moe_cases import v2_lite_experts

    weights, d13, d2 = v2_lite_experts(fmt)
    hidden = hidden_states(t, 2048, torch.bfloat16, "cuda", seed=t)
    rtw, rids = _remote(*random_topk(t, 66, 8, "cuda"), keep=list(range(33, 66)))
    out = fm.fused_moe(hidden, weights, rtw, rids)
    ref = moe_experts_reference(hidden, d13, d2, rtw, torch.where(rids < 0, 0, rids), fp8_acts=fmt == "fp8")
    tol = _tol(fmt, torch.bfloat16)
    check_close(out, ref, tol, block_tol=3 * tol, what=fmt)
