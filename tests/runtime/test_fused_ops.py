"""layers/fused.py: each kernel-path module the engine builds (routing kernel, SiLU-and-mul, MLA rope in
place, MoE sum with the residual add) gives its reference module's output on the same weights and fresh
random inputs (the reference: the same module run as its plain class). On CPU the kernels run
under the Triton interpreter in fp32; the gpu variant runs bf16 on CUDA."""
import pytest
import torch

from dsquant.models.attention import MLAttention
from dsquant.models.layers import GatedMLP
from dsquant.models.moe import MoE, Router
from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
from dsquant.runtime.layers.attention import PagedContext
from dsquant.runtime.layers.fused import TritonGatedMLP, TritonMLAttention, TritonMoE, TritonRouter

ORIGINAL = {TritonRouter: Router, TritonGatedMLP: GatedMLP, TritonMLAttention: MLAttention, TritonMoE: MoE}


class _Capture:
    """Stand-in attention backend: returns q_pe and k_pe as they reach it."""

    mla_fused = None  # no fused path: attend runs the rope and calls mla

    def mla(self, module, q_nope, q_pe, kv_latent, k_pe, ctx):
        self.seen = (q_nope.clone(), q_pe.clone(), kv_latent.clone(), k_pe.clone())
        return torch.zeros(*q_nope.shape[:3], module.v_head_dim, dtype=q_nope.dtype, device=q_nope.device)


def _reference(module, *args):
    fused = type(module)
    module.__class__ = ORIGINAL[fused]
    try:
        return module(*args)
    finally:
        module.__class__ = fused


def _reference_call(module, method, *args):
    fused = type(module)
    module.__class__ = ORIGINAL[fused]
    try:
        return getattr(module, method)(*args)
    finally:
        module.__class__ = fused


def _check_layer(model, dtype, device, t=5):
    layer = model.model.layers[1]
    # the MoE's shared experts are folded into its grouped experts: check the dense layer's MLP
    router, shared, attn = layer.mlp.gate, model.model.layers[0].mlp, layer.self_attn
    assert (type(router), type(shared), type(attn)) == (TritonRouter, TritonGatedMLP, TritonMLAttention)
    hidden = torch.randn(t, model.config.hidden_size, dtype=dtype, device=device)
    w, ids = router(hidden)
    ref_w, ref_ids = _reference(router, hidden)
    assert ids.dtype == torch.int32 and torch.equal(ids.long().sort(-1)[0], ref_ids.sort(-1)[0])
    torch.testing.assert_close(w.gather(1, ids.long().argsort(-1)), ref_w.gather(1, ref_ids.argsort(-1)),
                               rtol=1e-3 if dtype != torch.float32 else 2e-6, atol=1e-6)
    e = model.config.n_routed_experts
    w2, ids2 = router(hidden, n_shared=1)  # the folded shared expert appended: id E, weight 1
    assert torch.equal(ids2[:, :-1], ids) and torch.equal(w2[:, :-1], w)
    assert (ids2[:, -1] == e).all() and (w2[:, -1] == 1).all()
    x = torch.randn(1, t, model.config.hidden_size, dtype=dtype, device=device)
    torch.testing.assert_close(shared(x), _reference(shared, x))
    moe, residual = layer.mlp, torch.randn_like(x)
    assert type(moe) is TritonMoE and moe.adds_residual() and moe.backend.num_folded(moe) == 1
    ref = _reference(moe, x)  # the experts' sum, then + shared and + residual as separate adds
    torch.testing.assert_close(moe(x), ref)
    torch.testing.assert_close(moe(x, residual=residual), residual + ref)
    positions = torch.randint(0, 200, (1, t), device=device)
    cos, sin = model.rope_cos_sin(positions)  # [1, T, rope/2]
    ctx = PagedContext(cos=cos, sin=sin, slot_mapping=None, block_tables=None, seq_lens=None, cu_seqlens_q=None)
    backend, attn.backend = attn.backend, _Capture()
    try:
        assert attn.fused_qkv_a is not None and not list(attn.kv_a_proj_with_mqa.parameters())
        q, latent = attn.project(x)  # one GEMM: the loader fused q_proj and kv_a (fused_linear.py)
        q = q.view(1, t, attn.num_heads, -1)
        attn.attend(q.clone(), latent.clone(), ctx)
        got = attn.backend.seen
        _reference_call(attn, "attend", q.clone(), latent.clone(), ctx)
        for name, a, b in zip(("q_nope", "q_pe", "kv_latent", "k_pe"), got, attn.backend.seen):
            torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")
    finally:
        attn.backend = backend


def _engine(path, device, dtype):
    return LLMEngine(path, EngineConfig(device=device, dtype=dtype, block_size=4, num_blocks=16,
                                        max_model_len=64, kernels=True, enforce_eager=True))


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_fused_modules_match_reference(family, tiny_models):
    _, path = tiny_models[family]
    with torch.inference_mode():
        _check_layer(_engine(path, "cpu", torch.float32).model, torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_fused_modules_match_reference_bf16_cuda(family, tiny_models):
    _, path = tiny_models[family]
    with torch.inference_mode():
        _check_layer(_engine(path, "cuda", torch.bfloat16).model, torch.bfloat16, "cuda", t=64)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_fused_route_matches_reference_bf16_cuda(family, tiny_models, monkeypatch):
    """Decode-sized batches with router_route on (router logits and routing in one launch)."""
    from dsquant.runtime.kernels.moe import router_gemv

    monkeypatch.setattr(router_gemv, "FUSED_ROUTE_MIN_HIDDEN", 0)  # the tiny models' hidden size takes it
    _, path = tiny_models[family]
    with torch.inference_mode():
        model = _engine(path, "cuda", torch.bfloat16).model
        _check_layer(model, torch.bfloat16, "cuda", t=5)
        assert model.model.layers[1].mlp.gate.route_counters is not None  # the fused launch ran
