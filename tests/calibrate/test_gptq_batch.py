"""GPTQ at DeepSeek-V3 scale: routed experts quantized in batches, Hessians shared by Linears fed
the same tensor, and a layer's results kept compact until written. Each must change nothing:
the batched GPTQ equals expert-by-expert GPTQ, the shared Hessian equals a separate one, and a
quantized checkpoint is identical with the batching turned off."""
from __future__ import annotations

import torch
from safetensors.torch import load_file
from torch import nn

from dsquant.calibrate import layer as layer_mod
from dsquant.calibrate.capture import LayerCapture
from dsquant.calibrate.gptq import HessianAccumulator, gptq_quantize, gptq_quantize_batch
from dsquant.calibrate.quantizers import int_grid
from dsquant.calibrate.recipe import GPTQOptions, SchemeSpec
from tests.calibrate.test_quantize import quantize
from tests.tiny_checkpoints import write_tiny_v3


def _experts(n_experts: int, n: int, k: int, seed: int = 0):
    """Weights [E, N, K] whose group scales vary over orders of magnitude per expert, with an outlier
    channel each, and Hessians from inputs of different sizes, one with a dead channel."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_experts, n, k, generator=g) * torch.logspace(-2, 1, k)[torch.randperm(k, generator=g)]
    w = w * 10 ** (torch.rand(n_experts, 1, 1, generator=g) * 2 - 1)
    hs = []
    for e in range(n_experts):
        w[e, :, (7 * e) % k] *= 30
        x = torch.randn(16 + 40 * e, k, generator=g) * (0.1 + 5 * torch.rand(k, generator=g))
        if e == 1:
            x[:, 3] = 0  # a channel this expert never saw: a dead Hessian column
        acc = HessianAccumulator(k, "cpu")
        acc.add(x)
        hs.append(acc)
    return w, hs


def test_batched_gptq_equals_one_by_one():
    w, hs = _experts(5, 48, 128)
    h = torch.stack([a.h for a in hs])
    for act_order, static in ((False, False), (True, False), (False, True), (True, True)):
        for sym, group in ((True, 32), (False, 64), (True, 128)):
            spec = SchemeSpec("gptq", 4, group)
            opts = GPTQOptions(act_order=act_order, sym=sym, static_groups=static)
            got = gptq_quantize_batch(w, h, spec, opts, torch.float16)
            for e in range(w.shape[0]):
                want = gptq_quantize(w[e], hs[e], spec, opts, torch.float16)
                where = f"expert {e}, act_order {act_order}, static {static}, g{group}"
                assert torch.equal(got[e].q, want.q), where
                assert torch.equal(got[e].g_idx, want.g_idx), where
                torch.testing.assert_close(got[e].dequantized, want.dequantized, rtol=1e-6, atol=0, msg=where)
                torch.testing.assert_close(got[e].scales, want.scales, rtol=0, atol=0, msg=where)
    # the experts differ, so a batch mixing them up would have failed above
    assert not torch.equal(got[0].scales, got[1].scales)


class _MLP(nn.Module):
    def __init__(self, k: int, m: int):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(k, m, False), nn.Linear(k, m, False), nn.Linear(m, k, False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def test_linears_fed_one_tensor_share_one_hessian():
    torch.manual_seed(0)
    mlp = _MLP(32, 48)
    names = {f"p.{n}" for n in ("gate_proj", "up_proj", "down_proj")}
    xs = [torch.randn(4, 10, 32) * torch.logspace(-1, 1, 32) for _ in range(3)]
    with LayerCapture(mlp, "p", names, max_rows=1000) as data:
        for x in xs:
            mlp(x)
    h = data.hessians
    assert h["p.gate_proj"] is h["p.up_proj"] and h["p.down_proj"] is not h["p.gate_proj"]
    want = HessianAccumulator(32, "cpu")
    for x in xs:
        want.add(x)
    torch.testing.assert_close(h["p.gate_proj"].h, want.h, rtol=1e-5, atol=1e-6)
    assert h["p.gate_proj"].n == 120  # counted once, not once per Linear


def test_compact_keeps_what_export_needs():
    w = torch.randn(16, 64) * torch.logspace(-2, 1, 64)
    qw = int_grid(w, SchemeSpec("rtn", 4, 32), torch.float16)
    small = qw.compact()
    assert small.dequantized is None and small.q.dtype == torch.uint8
    assert torch.equal(small.q.to(torch.int32), qw.q) and small.scales is qw.scales


def test_quantized_checkpoint_is_the_same_without_batching(tmp_path, monkeypatch):
    model = write_tiny_v3(tmp_path / "m")
    quantize(model, "gptq-w4g128", tmp_path / "batched")
    batches = []
    real = layer_mod._expert_gptq_batches
    monkeypatch.setattr(layer_mod, "GPTQ_BATCH_BYTES", 1)  # one expert per batch
    monkeypatch.setattr(layer_mod, "_expert_gptq_batches", lambda *a: batches.append(real(*a)) or [])
    quantize(model, "gptq-w4g128", tmp_path / "sequential")
    assert batches and all(len(b) == 1 for group in batches for b in group)  # MoE layers had batches
    shards = sorted(p.name for p in (tmp_path / "batched").glob("*.safetensors"))
    assert shards
    for name in shards:
        a, b = load_file(tmp_path / "batched" / name), load_file(tmp_path / "sequential" / name)
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}: {key}"


def test_static_groups_take_their_grid_from_the_weights_before_gptq_moves_them():
    from dsquant.formats.int_grid import dequantize_int_groupwise, quantize_int_groupwise

    w, hs = _experts(1, 32, 128, seed=3)
    spec = SchemeSpec("gptq", 4, 32)
    for sym in (True, False):
        for act_order in (False, True):
            static = gptq_quantize(w[0], hs[0], spec, GPTQOptions(sym=sym, act_order=act_order, static_groups=True),
                                   torch.float16)
            lazy = gptq_quantize(w[0], hs[0], spec, GPTQOptions(sym=sym, act_order=act_order, static_groups=False),
                                 torch.float16)
            if sym:  # the symmetric grid is RTN's symmetric grid of the original weights, in column order
                _, scales, zeros = quantize_int_groupwise(w[0], 32, 4, symmetric=True)
                torch.testing.assert_close(static.scales.float(), scales.to(torch.float16).float(), rtol=0, atol=0)
                assert torch.equal(static.zeros, zeros)
            assert torch.equal(static.g_idx, torch.arange(128, dtype=torch.int32) // 32)  # identity, even act-order
            assert not torch.equal(static.scales, lazy.scales)  # the lazy grid follows the updated weights
            assert not torch.equal(static.q, lazy.q)
            # the codes on the stored grid give the dequantized weight (what a reader computes)
            rebuilt = dequantize_int_groupwise(static.q, static.scales.float(), static.zeros, 32)
            torch.testing.assert_close(rebuilt, static.dequantized, rtol=0, atol=0)
        if act_order:  # act-order changes which columns absorb the error
            plain = gptq_quantize(w[0], hs[0], spec, GPTQOptions(sym=sym, act_order=False), torch.float16)
            assert not torch.equal(plain.q, static.q)
