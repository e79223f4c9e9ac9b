"""RoPE kernel against transformers' own rotary functions (neox, V3 interleave, V2 complex)."""
import pytest
import torch
from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    apply_rotary_pos_emb, apply_rotary_pos_emb_interleave)

from dsquant.runtime.kernels.ops.rope import apply_rope


def _cache(max_pos, rot, device, factor=1.0):
    """cos/sin [max_pos, R/2] fp32, with a stand-in attention factor as YaRN bakes it in."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)  # [max_pos, R/2]
    return ((freqs.cos() * factor).float().to(device), (freqs.sin() * factor).float().to(device))


def _hf(layout, deinterleave, q, k, cos, sin, positions):
    """transformers' functions on [1, H, T, R] in float64 (the oracle)."""
    qh, kh = q.double().transpose(0, 1)[None], k.double().transpose(0, 1)[None]
    c, s = cos[positions].double(), sin[positions].double()  # [T, R/2]
    if layout == "interleaved" and not deinterleave:
        freqs_cis = torch.polar(torch.ones_like(c), torch.atan2(s, c)) * torch.sqrt(c * c + s * s)
        qo, ko = apply_rotary_emb(qh, kh, freqs_cis[None])
    else:
        fn = apply_rotary_pos_emb_interleave if layout == "interleaved" else apply_rotary_pos_emb
        qo, ko = fn(qh, kh, torch.cat([c, c], -1)[None], torch.cat([s, s], -1)[None])
    return qo[0].transpose(0, 1), ko[0].transpose(0, 1)  # [T, H, R]


def _check(t, hq, hk, rot, layout, deinterleave, dtype, device, nope=0):
    cos, sin = _cache(4096, rot, device, factor=1.3)
    positions = torch.randint(0, 4096, (t,), device=device)
    q_full = torch.randn(t, hq, nope + rot, dtype=dtype, device=device)
    k = torch.randn(t, hk, rot, dtype=dtype, device=device)
    q_before, k_before = q_full.clone(), k.clone()
    q = q_full[..., nope:]  # the rope slice, as DeepSeek's q_pe
    apply_rope(positions, q, k, cos, sin, layout=layout, deinterleave=deinterleave)
    assert torch.isfinite(q_full).all() and torch.isfinite(k).all()
    assert torch.equal(q_full[..., :nope], q_before[..., :nope]), "the nope part must stay untouched"
    ref_q, ref_k = _hf(layout, deinterleave, q_before[..., nope:], k_before, cos, sin, positions)
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-3
    for name, got, ref in (("q", q, ref_q), ("k", k, ref_k)):
        err = (got.double() - ref).norm() / ref.norm()
        assert err < tol, f"{name}: relative error {err:.2e}"


CASES = [("neox", True), ("interleaved", True), ("interleaved", False)]


@pytest.mark.parametrize("layout,deinterleave", CASES)
@pytest.mark.parametrize("t,hq,hk,rot,nope", [(1, 4, 1, 16, 0), (6, 3, 3, 32, 8), (5, 16, 1, 64, 128)])
def test_rope_matches_transformers(t, hq, hk, rot, nope, layout, deinterleave, device):
    _check(t, hq, hk, rot, layout, deinterleave, torch.float16, device, nope)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,deinterleave", CASES)
@pytest.mark.parametrize("t,hq,hk,rot,nope", [(1, 128, 1, 64, 128), (4096, 16, 1, 64, 128), (777, 32, 8, 128, 0)])
def test_rope_bf16_full_size(t, hq, hk, rot, nope, layout, deinterleave, device):
    _check(t, hq, hk, rot, layout, deinterleave, torch.bfloat16, device, nope)


def test_rope_rejects_wrong_rotary_width(device):
    cos, sin = _cache(16, 16, device)
    q = torch.randn(2, 2, 32, device=device)
    with pytest.raises(ValueError, match="q must be"):
        apply_rope(torch.zeros(2, dtype=torch.long, device=device), q, q.clone(), cos, sin)


@pytest.mark.parametrize("layout,deinterleave", CASES)
def test_rope_per_token_cos_sin_matches_cache_lookup(layout, deinterleave, device):
    """positions=None with cos/sin already gathered per token [T, R/2] (the runtime's PagedContext)
    rotates exactly as the cache lookup by positions does, on strided views (q's rope slice,
    k_pe inside the latent row) left in place."""
    cos, sin = _cache(512, 16, device, factor=1.3)
    positions = torch.randint(0, 512, (7,), device=device)
    q_full = torch.randn(7, 4, 16 + 16, dtype=torch.float16, device=device)  # [T, H, nope + rope]
    latent = torch.randn(7, 32 + 16, dtype=torch.float16, device=device)  # [T, R + rope]
    q_ref, k_ref = q_full[..., 16:].clone(), latent[:, None, 32:].clone()
    apply_rope(positions, q_ref, k_ref, cos, sin, layout=layout, deinterleave=deinterleave)
    latent_before = latent.clone()
    apply_rope(None, q_full[..., 16:], latent[:, None, 32:], cos[positions].contiguous(),
               sin[positions].contiguous(), layout=layout, deinterleave=deinterleave)
    assert torch.equal(q_full[..., 16:], q_ref) and torch.equal(latent[:, None, 32:], k_ref)
    assert torch.equal(latent[:, :32], latent_before[:, :32]), "the latent part must stay untouched"
    with pytest.raises(ValueError, match="per token"):
        apply_rope(None, q_full[..., 16:], latent[:, None, 32:], cos, sin, layout=layout)
