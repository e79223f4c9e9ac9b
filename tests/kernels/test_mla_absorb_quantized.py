"""Absorbed MLA (TritonPagedAttention) with kv_b_proj quantized: FP8 block, AWQ, GPTQ (plain and
act-order g_idx), drawn by tests/realistic_weights.py, so every FP8 block / INT4 group has its
own scale (three orders of magnitude), with outlier latent channels, zero rows and a zero tile.

kv_b_proj [H * (nope + v), R] is built by the runtime's LinearFactory (FP8 kv_b_proj forced
weight-only there) and filled with the checkpoint tensors; `TritonPagedAttention.prepare` takes
W_UK [H, nope, R] / W_UV [H, v, R] from it before the layer repacks (the loader's order), then
- path "mla": backend.mla (W_UK einsum, store_latent, split decode, mla_merge_uv or merge + einsum),
- path "fused": TritonMLAttention.attend -> backend.mla_fused (mla_prepare: q rope, W_UK, kv_a
  RMSNorm, k rope, cache store; then the same decode and W_UV),
for a decode step (one new token per sequence, contexts 1 / 37 / 70) and a chunked prefill
(cached prefixes 0 and 21, 3 and 6 new tokens), through each of _attend_absorbed's three endings
(mla_merge_uv; merge_splits + W_UV einsum; one split + einsum: VARIANTS). The reference is the
NON-absorbed attention in float64: per-head K = [W_UK c ; k_pe], V = W_UV c with W the dense
weight rebuilt from the quantizer's codes and scales (tests/quantized_weights.py), RMSNorm and
rope in float64 for the fused path. Held per head (max_block_rel_err over blocks of v outputs),
so a head whose W_UV has small scales is not hidden by the large ones.

The absorbed weights themselves are checked first (per head, to the compute dtype's rounding),
and on the GPU the CUDA repack that follows `prepare` must leave them untouched. Tensor
parallel: kv_b_proj column-sharded by heads (parallel/linear.shard_linear, as parallel/model.py
splits it), each rank absorbing its own heads; the ranks' outputs, heads concatenated, equal the
unsharded reference. CPU: fp16, small shapes; gpu-marked: bf16 at V2-Lite (16 heads, R 512,
nope 128, rope 64, v 128) and V3 (128 heads) shapes, TP 2 / 4 (V2-Lite) and 8 (V3).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from dsquant.config import ModelConfig
from dsquant.models.layers import Backends
from dsquant.runtime.kernels.attention.reference_attention import gather_paged, make_block_table
from dsquant.runtime.layers.attention import PagedContext
from dsquant.runtime.layers.attention_triton import TritonPagedAttention
from dsquant.runtime.layers.fused import TritonMLAttention
from dsquant.runtime.layers.linear import LinearFactory
from dsquant.runtime.parallel.linear import COLUMN, Part, shard_linear
from dsquant.runtime.parallel.state import ParallelState
from tests.quantized_weights import FORMATS, realistic_quantized
from tests.realistic_weights import max_block_rel_err, realistic_activations

PREFIX = "model.layers.0.self_attn"
GROUP = {"fp8": 128, "awq": 128, "gptq": 64, "gptq_act_order": 64, "ct_int4": 64, "ct_int4_act_order": 64,
         "ct_fp8": 128}
EPS = 1e-6
LOGIT_STD = 2.5  # the q scale is set per head so that scores have about this spread


def mla_module(heads, nope, rope, v, rank, quant_config, backend):
    """The MLA module the engine's kernel path builds (layers/fused.TritonMLAttention);
    only kv_b_proj and kv_a_layernorm are materialised."""
    cfg = ModelConfig(architecture="DeepseekV3ForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=1 << 16, kv_lora_rank=rank, qk_nope_head_dim=nope,
                      qk_rope_head_dim=rope, v_head_dim=v, raw={"quantization_config": quant_config})
    return TritonMLAttention(cfg, PREFIX, Backends(linear=LinearFactory(quant_config)), backend)


def fill(layer, tensors: dict, device, dtype):
    for name, t in tensors.items():
        assert tuple(layer._parameters[name].shape) == tuple(t.shape), name
        layer._parameters[name] = torch.nn.Parameter(t.to(device), requires_grad=False)
    layer.compute_dtype = dtype


def rope64(x, cos, sin):
    """DeepSeek interleaved rope in float64, de-interleaved output (models.rope.apply_rope's layout).
    x [T, ..., P], cos/sin [T, P/2]."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.double().view(shape), sin.double().view(shape)
    x1, x2 = x[..., 0::2].double(), x[..., 1::2].double()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def rms64(x, w, eps=EPS):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


class Case:
    """Sequences over a paged latent cache: context tokens written into the cache beforehand,
    new tokens given as the projections' outputs; the float64 per-position latent of each."""

    def __init__(self, device, dtype, heads, nope, rope, v, rank, ctx_lens, q_lens, block_size, seed):
        self.device, self.dtype = device, dtype
        self.heads, self.nope, self.rope, self.v, self.rank = heads, nope, rope, v, rank
        self.ctx_lens, self.q_lens = ctx_lens, q_lens
        self.seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
        gen = torch.Generator().manual_seed(seed)
        num_blocks = sum(-(-n // block_size) for n in self.seq_lens) + 3
        self.table = make_block_table(self.seq_lens, block_size, num_blocks, gen)  # [B, max_blocks]
        width = rank + rope
        self.cache = torch.full((num_blocks, block_size, width), float("nan"), dtype=dtype)
        t = sum(q_lens)
        # context: normed latents (outlier channels, as trained kv_a norms give) and rotated rope keys
        for b, n in enumerate(ctx_lens):
            if n:
                lat = torch.cat([realistic_activations(n, rank, seed=seed + 10 + b),
                                 torch.randn(n, rope, generator=gen)], -1)
                pos = torch.arange(n)
                self.cache[self.table[b].long()[pos // block_size], pos % block_size] = lat.to(dtype)
        self.cache = self.cache.to(device)
        pos_new = [torch.arange(c, c + q) for c, q in zip(ctx_lens, q_lens)]
        self.slots = torch.cat([self.table[b].long()[p // block_size] * block_size + p % block_size
                                for b, p in enumerate(pos_new)])  # [T]
        self.angles = torch.cat(pos_new)[:, None].float() * (0.3 + torch.rand(rope // 2, generator=gen))  # [T, P/2]
        # new tokens: raw kv_a output (before its RMSNorm) for the fused path, normed for "mla"
        self.latent_raw = torch.cat([realistic_activations(t, rank, seed=seed + 1) * 3,
                                     torch.randn(t, rope, generator=gen)], -1).to(dtype)  # [T, R + P]
        self.norm_w = (1 + 0.3 * torch.randn(rank, generator=gen)).to(dtype)
        self.q_raw = torch.randn(t, heads, nope + rope, generator=gen)  # q_nope scaled per head later
        self.kv_latent = (torch.randn(t, rank, generator=gen) * (1 + 0.5 * torch.rand(rank, generator=gen))).to(dtype)
        self.k_pe = torch.randn(t, rope, generator=gen).to(dtype)  # "mla": already rotated
        self.q_pe_rot = torch.randn(t, heads, rope, generator=gen).to(dtype)

    def context(self, is_decode: bool) -> PagedContext:
        d = self.device
        cu = torch.tensor([0] + list(torch.tensor(self.q_lens).cumsum(0)), dtype=torch.int32)
        angles = self.angles.to(d)
        return PagedContext(cos=angles.cos()[None], sin=angles.sin()[None], slot_mapping=self.slots.to(d),
                            block_tables=self.table.to(d), seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32,
                                                                                  device=d),
                            cu_seqlens_q=cu.to(d), max_q_len=max(self.q_lens), max_seq_len=max(self.seq_lens),
                            is_decode=is_decode, q_lens_host=list(self.q_lens), seq_lens_host=list(self.seq_lens))

    def new_latents64(self, fused: bool) -> torch.Tensor:
        """[T, R + P] float64: what each new token contributes as key / value source."""
        r = self.rank
        if fused:
            return torch.cat([rms64(self.latent_raw[:, :r], self.norm_w), rope64(self.latent_raw[:, r:],
                              self.angles.cos(), self.angles.sin())], -1)
        return torch.cat([self.kv_latent, self.k_pe], -1).double()

    def scale_q(self, w_uk64: torch.Tensor, scaling: float, fused: bool) -> None:
        """Scale q_nope per head so that the nope part of the scores has a spread of LOGIT_STD
        (realistic weights put some heads' keys orders of magnitude above others)."""
        lat = torch.cat([self.cache_latents64()[:, :self.rank], self.new_latents64(fused)[:, :self.rank]])
        k = torch.einsum("lr,hnr->hln", lat, w_uk64)  # [H, L, nope]
        spread = k.std(dim=(1, 2)).clamp(min=1e-30) * math.sqrt(self.nope) * scaling  # [H]
        self.q_raw[..., :self.nope] *= (LOGIT_STD / spread)[None, :, None].float()

    def cache_latents64(self) -> torch.Tensor:
        cache = self.cache.cpu().double()
        rows = [gather_paged(cache, self.table[b], n) for b, n in enumerate(self.ctx_lens) if n]
        return torch.cat(rows) if rows else cache.new_zeros(0, self.rank + self.rope)

    def reference(self, dense64: torch.Tensor, scaling: float, fused: bool) -> torch.Tensor:
        """Non-absorbed attention [T, H, v] in float64 from the dense kv_b_proj [H (nope + v), R]."""
        h, nope, v, r = self.heads, self.nope, self.v, self.rank
        w = dense64.view(h, nope + v, r)
        w_uk, w_uv = w[:, :nope], w[:, nope:]
        q = self.q_raw.to(self.dtype).double()
        q_nope = q[..., :nope]
        q_pe = rope64(q[..., nope:], self.angles.cos(), self.angles.sin()) if fused else self.q_pe_rot.double()
        new = self.new_latents64(fused)
        cache = self.cache.cpu().double()
        out, start = [], 0
        for b, (c, ql) in enumerate(zip(self.ctx_lens, self.q_lens)):
            lat = torch.cat([gather_paged(cache, self.table[b], c), new[start:start + ql]])  # [L, R + P]
            kv_c, k_pe = lat[:, :r], lat[:, r:]
            k = torch.cat([torch.einsum("lr,hnr->hln", kv_c, w_uk),
                           k_pe[None].expand(h, -1, -1)], -1)  # [H, L, nope + P]
            val = torch.einsum("lr,hvr->hlv", kv_c, w_uv)  # [H, L, v]
            qb = torch.cat([q_nope[start:start + ql], q_pe[start:start + ql]], -1).transpose(0, 1)  # [H, ql, nope+P]
            s = qb @ k.transpose(1, 2) * scaling  # [H, ql, L]
            causal = torch.arange(c + ql)[None] <= torch.arange(c, c + ql)[:, None]  # [ql, L]
            out.append((s.masked_fill(~causal, float("-inf")).softmax(-1) @ val).transpose(0, 1))  # [ql, H, v]
            start += ql
        return torch.cat(out)

    def run(self, backend, module, path: str, is_decode: bool) -> torch.Tensor:
        d, dt = self.device, self.dtype
        backend.layer_index, backend.kv_caches = {module: 0}, [(self.cache,)]
        module.kv_a_layernorm.weight = torch.nn.Parameter(self.norm_w.to(d), requires_grad=False)
        ctx = self.context(is_decode)
        if path == "fused":
            q = self.q_raw.to(d, dt)[None]  # [1, T, H, nope + P], rope part rotated in place
            fused = backend.mla_fused
            calls = []
            backend.mla_fused = lambda *args: calls.append(1) or fused(*args)
            out = module.attend(q, self.latent_raw.to(d)[None], ctx)[0]
            assert calls, "TritonMLAttention.attend did not take the fused three-launch path"
            return out
        q = self.q_raw.to(dt)
        return backend.mla(module, q[None, :, :, :self.nope].to(d), self.q_pe_rot.to(d)[None],
                           self.kv_latent.to(d)[None], self.k_pe.to(d)[None], ctx)[0]


def kv_b_proj_weight(fmt, heads, nope, v, rank, seed):
    return realistic_quantized(fmt, heads * (nope + v), rank, seed=seed, group=GROUP[fmt])


def absorbed_module(fmt, qw, heads, nope, rope, v, rank, device, dtype, world=1, rank_id=0):
    """(backend, module, dense float64 kv_b_proj of this rank's heads): kv_b_proj holding `qw`
    (quantized in `fmt`), W_UK / W_UV taken by TritonPagedAttention.prepare, then the layer's own
    repack. world > 1: the module is TP rank `rank_id`'s, kv_b_proj column-sharded by heads as
    runtime/parallel/model.py shards it."""
    backend = TritonPagedAttention()
    module = mla_module(heads, nope, rope, v, rank, qw.config, backend)
    proj = module.kv_b_proj
    assert proj.method.name == {"fp8": "fp8_block", "ct_int4": "ct_int4", "ct_int4_act_order": "ct_int4",
                                "ct_fp8": "ct_fp8"}.get(fmt, fmt.split("_")[0])
    if fmt in ("fp8", "ct_fp8"):
        assert proj.method.dynamic_activations is False  # absorbed: kv_b_proj's input is never quantized
    tensors, dense = qw.tensors, qw.dense
    if world > 1:
        per_head = nope + v
        parts = [Part(q.start * per_head, q.stop * per_head) for q in (Part.of(heads, r, world) for r in range(world))]
        full = {f"{PREFIX}.kv_b_proj.{a}": t for a, t in tensors.items()}
        reader = SimpleNamespace(get=full.__getitem__, layer_keys=lambda layer: list(full))
        rules, _ = shard_linear(proj, COLUMN, parts, ParallelState(rank_id, world), reader,
                                lambda key: qw.dense.float())
        tensors = {name: rules[f"{PREFIX}.kv_b_proj.{name}"]() if f"{PREFIX}.kv_b_proj.{name}" in rules
                   else full[f"{PREFIX}.kv_b_proj.{name}"] for name in proj._parameters}
        module.num_heads = Part.of(heads, rank_id, world).size
        dense = qw.dense[parts[rank_id].slice]
    fill(proj, tensors, device, dtype)
    backend.prepare(SimpleNamespace(self_attn=module))
    proj.method.process_weights_after_loading(proj)  # CUDA: repack (and drop qweight / scales)
    return backend, module, dense


def check_absorbed_weights(backend, module, dense64, dtype):
    h, nope, v = module.num_heads, module.qk_nope_head_dim, module.v_head_dim
    w_uk, w_uv = backend.absorbed[module]
    assert w_uk.dtype == dtype and w_uk.shape == (h, nope, module.kv_lora_rank) and w_uv.shape[1] == v
    w = dense64.view(h, nope + v, -1)
    tol = torch.finfo(dtype).eps
    for name, got, want in (("W_UK", w_uk, w[:, :nope]), ("W_UV", w_uv, w[:, nope:])):
        for head in range(h):
            err = (got[head].cpu().double() - want[head]).norm() / want[head].norm().clamp(min=1e-300)
            assert err <= tol, f"{name} head {head}: relative error {err:.3g} > {tol:.3g}"


def check_attention(fmt, path, is_decode, device, dtype, heads, nope, rope, v, rank, ctx_lens, q_lens,
                    block_size, tol, seed=0):
    qw = kv_b_proj_weight(fmt, heads, nope, v, rank, seed)
    backend, module, dense = absorbed_module(fmt, qw, heads, nope, rope, v, rank, device, dtype)
    check_absorbed_weights(backend, module, dense, dtype)
    case = Case(device, dtype, heads, nope, rope, v, rank, ctx_lens, q_lens, block_size, seed)
    fused = path == "fused"
    case.scale_q(dense.view(heads, nope + v, rank)[:, :nope], module.scaling, fused)
    out = case.run(backend, module, path, is_decode)  # [T, H, v]
    ref = case.reference(dense, module.scaling, fused)
    assert out.shape == ref.shape and out.dtype == dtype
    t = ref.shape[0]
    worst = max_block_rel_err(out.reshape(t, -1), ref.reshape(t, -1), block=v)  # per head
    assert worst < tol, f"{fmt} {path}: worst per-head relative error {worst:.3g} >= {tol}"
    return worst


# CPU (the interpreter; on a CUDA host the same cases run there): 2 heads, nope 32, v 48 -> kv_b_proj N = 160: a partial FP8 row block (32 rows), head 1
# straddling the block edge; R = 256 (two FP8 blocks, two AWQ groups, four GPTQ groups)
SMALL = dict(heads=2, nope=32, rope=16, v=48, rank=256, block_size=16)
DECODE = dict(ctx_lens=[0, 36, 69], q_lens=[1, 1, 1])  # seq lens 1, 37, 70
PREFILL = dict(ctx_lens=[0, 21], q_lens=[3, 6])  # 9 rows > MERGE_UV_MAX_ROWS
CPU_TOL = 5e-3  # fp16: measured 4e-4 .. 9e-4
# (path, decode?, SMs the split heuristic sees): the three ways _attend_absorbed ends. 132 (the
# CPU default): 16 splits, decode -> mla_merge_uv; 8 SMs: 2 splits of 9 prefill rows -> merge_splits
# + W_UV einsum; 1 SM: one split -> mla_decode_attention + W_UV einsum (fewer splits: faster here)
VARIANTS = [("mla", True, 132), ("fused", True, 132), ("fused", False, 8), ("mla", False, 1)]


def patch_sms(monkeypatch, sms: int) -> None:
    from dsquant.runtime.kernels.attention import mla_decode_plan

    monkeypatch.setattr(mla_decode_plan, "num_sms", lambda device: sms)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path,is_decode,sms", VARIANTS,
                         ids=["mla-decode-merge_uv", "fused-decode-merge_uv", "fused-prefill-2splits",
                              "mla-prefill-1split"])
def test_absorbed_mla_with_quantized_kv_b_proj(fmt, path, is_decode, sms, monkeypatch, device):
    patch_sms(monkeypatch, sms)
    phase = DECODE if is_decode else PREFILL
    check_attention(fmt, path, is_decode, device, torch.float16, **SMALL, **phase, tol=CPU_TOL)


def check_tp_attention(fmt, world, device, dtype, heads, nope, rope, v, rank, ctx_lens, q_lens, block_size,
                       tol, seed=3):
    """Each TP rank absorbs its heads' slice of kv_b_proj (column-sharded by heads); the ranks'
    fused-path outputs, heads concatenated, equal the unsharded float64 attention."""
    shapes = dict(heads=heads, nope=nope, rope=rope, v=v, rank=rank)
    phase = dict(ctx_lens=ctx_lens, q_lens=q_lens, block_size=block_size, seed=seed)
    qw = kv_b_proj_weight(fmt, heads, nope, v, rank, seed)
    case = Case(device, dtype, **shapes, **phase)
    scaling = (nope + rope) ** -0.5  # MLAttention.scaling without YaRN
    case.scale_q(qw.dense.view(heads, nope + v, rank)[:, :nope], scaling, fused=True)
    ref = case.reference(qw.dense, scaling, fused=True)  # [T, H, v]
    outs = []
    for rank_id in range(world):
        backend, module, dense = absorbed_module(fmt, qw, **shapes, device=device, dtype=dtype, world=world,
                                                 rank_id=rank_id)
        if fmt == "fp8":
            assert module.kv_b_proj.method.name == "fp8_block"  # sharded in its own layout, not dense
        check_absorbed_weights(backend, module, dense, dtype)
        part = Part.of(heads, rank_id, world)
        sub = Case(device, dtype, **shapes, **phase)  # the same cache and inputs, this rank's heads of q
        sub.heads, sub.q_raw = part.size, case.q_raw[:, part.slice].clone()
        outs.append(sub.run(backend, module, "fused", is_decode=True))  # [T, heads, v]
    out = torch.cat(outs, 1)
    worst = max_block_rel_err(out.reshape(out.shape[0], -1), ref.reshape(ref.shape[0], -1), block=v)
    assert worst < tol, f"TP{world} {fmt}: worst per-head relative error {worst:.3g}"


@pytest.mark.parametrize("fmt", ["fp8", "awq"])
@pytest.mark.parametrize("world", [2, 4])
def test_absorbed_mla_on_tensor_parallel_shards_of_kv_b_proj(fmt, world, monkeypatch, device):
    """4 heads of nope 32 + v 32 = 64 kv_b_proj rows: TP2 keeps whole FP8 blocks, TP4 64 rows
    inside one block (FP8 kept, the block's scale row repeated per rank)."""
    patch_sms(monkeypatch, 8)  # 4 splits of the decode (merge_uv), fewer programs to interpret
    check_tp_attention(fmt, world, device, torch.float16, heads=4, nope=32, rope=16, v=32, rank=256,
                       **DECODE, block_size=16, tol=CPU_TOL)


# ---------------------------------------------------------------- GPU: model shapes, bf16
V2_LITE = dict(heads=16, nope=128, rope=64, v=128, rank=512)
V3 = dict(V2_LITE, heads=128)
GPU_TOL = 3e-2  # bf16


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shapes", [V2_LITE, V3], ids=["v2-lite", "v3"])
@pytest.mark.parametrize("path,is_decode", [("mla", True), ("fused", True), ("mla", False), ("fused", False)],
                         ids=["mla-decode", "fused-decode", "mla-prefill", "fused-prefill"])
def test_absorbed_mla_with_quantized_kv_b_proj_gpu(fmt, shapes, path, is_decode):
    phase = (dict(ctx_lens=[0, 300, 2047, 64], q_lens=[1, 1, 1, 1]) if is_decode
             else dict(ctx_lens=[0, 700], q_lens=[33, 100]))
    check_attention(fmt, path, is_decode, "cuda", torch.bfloat16, **shapes, **phase, block_size=64, tol=GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "awq", "gptq"])
@pytest.mark.parametrize("shapes,world", [(V2_LITE, 2), (V2_LITE, 4), (V3, 8)], ids=["v2-lite-tp2", "v2-lite-tp4",
                                                                                      "v3-tp8"])
def test_absorbed_mla_on_tensor_parallel_shards_of_kv_b_proj_gpu(fmt, shapes, world):
    check_tp_attention(fmt, world, "cuda", torch.bfloat16, **shapes, ctx_lens=[0, 300, 2047, 64],
                       q_lens=[1, 1, 1, 1], block_size=64, tol=GPU_TOL)
