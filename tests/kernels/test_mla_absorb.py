"""mla_prepare (q rope + W_UK absorption + kv_a RMSNorm + k rope + latent store) and mla_merge_uv
(split merge + W_UV) against pure torch: the reference model's RMSNorm and rope, einsums, and the
log-sum-exp merge written out. Fresh random inputs; outputs and the cache poisoned with NaN."""
import math

import pytest
import torch

from dsquant.errors import DsquantError
from dsquant.models.rope import apply_rope
from dsquant.runtime.kernels.attention.mla_absorb import mla_merge_uv, mla_prepare


def _rms_ref(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _prepare_case(device, dtype, t, heads, nope, rank, rope, interleaved, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, nope + rope + 8, generator=g)[..., :nope + rope]  # a strided view, like q_proj's
    latent = torch.randn(t, rank + rope, generator=g) * 3
    w_uk = torch.randn(heads, nope, rank, generator=g) / math.sqrt(nope)
    norm_w = 1 + 0.1 * torch.randn(rank, generator=g)
    angles = torch.rand(t, rope // 2, generator=g) * 6.0
    block_size, num_blocks = 16, t // 16 + 2
    perm = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots = torch.where(torch.arange(t) == t // 2, -1, perm)  # one padding token
    to = dict(device=device)
    return (q.to(**to, dtype=dtype), latent.to(**to, dtype=dtype), norm_w.to(**to, dtype=dtype),
            angles.cos().to(device), angles.sin().to(device), w_uk.to(**to, dtype=dtype).contiguous(),
            torch.full((num_blocks, block_size, rank + rope), float("nan"), dtype=dtype, device=device),
            slots.to(device))


@pytest.mark.parametrize("t", [1, 5, 23])
@pytest.mark.parametrize("interleaved", [True, False])
def test_mla_prepare(device, t, interleaved):
    heads, nope, rank, rope, eps = 3, 32, 64, 16, 1e-6
    q, latent, norm_w, cos, sin, w_uk, cache, slots = _prepare_case(
        device, torch.float16, t, heads, nope, rank, rope, interleaved, seed=t)
    q_before = q.clone()
    q_abs = mla_prepare(q, latent, norm_w, eps, cos, sin, w_uk, cache, slots, interleaved)
    ref_abs = torch.einsum("thn,hnr->thr", q_before[..., :nope].float(), w_uk.float())
    torch.testing.assert_close(q_abs.float(), ref_abs, atol=2e-2, rtol=1e-2)
    ref_pe = apply_rope(q_before[None, ..., nope:], cos[None], sin[None], interleaved)[0]
    torch.testing.assert_close(q[..., nope:], ref_pe, atol=2e-3, rtol=0)
    assert torch.equal(q[..., :nope], q_before[..., :nope])  # q_nope untouched
    ref_c = _rms_ref(latent[:, :rank], norm_w, eps)
    ref_k = apply_rope(latent[None, :, None, rank:], cos[None], sin[None], interleaved)[0, :, 0]
    flat = cache.view(-1, rank + rope)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        torch.testing.assert_close(flat[s, :rank], ref_c[i], atol=2e-3, rtol=0)
        torch.testing.assert_close(flat[s, rank:], ref_k[i], atol=2e-3, rtol=0)
    written = set(s for s in slots.tolist() if s >= 0)
    untouched = [i for i in range(flat.shape[0]) if i not in written]
    assert torch.isnan(flat[untouched]).all()  # slot -1 stored nothing


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 100])
def test_mla_prepare_bf16_v2_lite_shapes(t):
    heads, nope, rank, rope = 16, 128, 512, 64
    q, latent, norm_w, cos, sin, w_uk, cache, slots = _prepare_case(
        "cuda", torch.bfloat16, t, heads, nope, rank, rope, True, seed=7)
    cache = torch.full((16, 16, rank + rope), float("nan"), dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(256, device="cuda")[:t]  # every token stored
    q_before = q.clone()
    q_abs = mla_prepare(q, latent, norm_w, 1e-6, cos, sin, w_uk, cache, slots, True)
    ref_abs = torch.einsum("thn,hnr->thr", q_before[..., :nope], w_uk)  # the bf16 einsum it replaces
    torch.testing.assert_close(q_abs.float(), ref_abs.float(), atol=3e-2, rtol=1e-2)
    flat = cache.view(-1, rank + rope)[slots]
    torch.testing.assert_close(flat[:, :rank].float(), _rms_ref(latent[:, :rank], norm_w, 1e-6).float(),
                               atol=2e-2, rtol=1e-2)
    ref_pe = apply_rope(q_before[None, ..., nope:], cos[None], sin[None], True)[0]
    torch.testing.assert_close(q[..., nope:].float(), ref_pe.float(), atol=2e-2, rtol=1e-2)


def _merge_ref(part_out, part_lse, w_uv, dtype):
    m = part_lse.amax(-1, keepdim=True)  # [T, H, 1]
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp2(part_lse - m)  # [T, H, S]
    total = w.sum(-1, keepdim=True)
    latent = (part_out * w[..., None]).sum(2) / torch.where(total > 0, total, torch.ones_like(total))
    return torch.einsum("thr,hvr->thv", latent.to(dtype).float(), w_uv.float())


@pytest.mark.parametrize("t,splits,live", [(1, 8, 8), (3, 1, 1), (6, 5, 5), (2, 64, 64), (2, 64, 11)])
def test_mla_merge_uv(device, t, splits, live):
    """live < splits: a short context in a launch sized for many splits (only the first `live`
    hold tokens, split_bounds); the merge reads no further and the rest are NaN garbage."""
    heads, rank, v_dim = 3, 64, 48
    g = torch.Generator().manual_seed(t * 10 + splits)
    part_out = torch.randn(t, heads, splits, rank, generator=g)
    part_lse = torch.randn(t, heads, splits, generator=g) * 4
    part_lse[0, 0, -1] = float("-inf")  # an empty split (its part_out is garbage, must not count)
    part_out[0, 0, -1] = float("nan")
    part_lse[:, :, live:] = float("-inf")
    part_out[:, :, live:] = float("nan")
    if t > 1:
        part_lse[1] = float("-inf")  # a padded row: every split empty -> zeros
    w_uv = (torch.randn(heads, v_dim, rank, generator=g) / math.sqrt(rank)).half()
    out = torch.full((t, heads, v_dim), float("nan"), dtype=torch.float16, device=device)
    mla_merge_uv(part_out.to(device), part_lse.to(device), w_uv.to(device), out=out)
    ref = _merge_ref(part_out.nan_to_num(0.0), part_lse, w_uv, torch.float16)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=1e-2)
    if t > 1:
        assert (out[1] == 0).all()


def test_mla_prepare_rejects_bad_shapes():
    q = torch.randn(2, 3, 48)
    with pytest.raises(DsquantError, match="w_uk"):
        mla_prepare(q, torch.randn(2, 80), torch.ones(64), 1e-6, torch.ones(2, 8), torch.ones(2, 8),
                    torch.randn(2, 32, 64), torch.zeros(4, 16, 80), torch.zeros(2, dtype=torch.int64), True)
