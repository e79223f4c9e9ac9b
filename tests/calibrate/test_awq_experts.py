"""AWQ's batched search over MoE experts' up -> down groups equals the expert-by-expert search."""
from __future__ import annotations

import torch

from dsquant.calibrate import awq
from dsquant.calibrate.recipe import AWQOptions, SchemeSpec


def _experts(n_experts: int, n: int, k: int, seed: int = 0) -> list[awq.Member]:
    g = torch.Generator().manual_seed(seed)
    spec = SchemeSpec("awq", bits=4, group_size=32)
    out = []
    for e in range(n_experts):
        w = torch.randn(n, k, generator=g) * 10 ** (torch.rand(1, generator=g) * 2 - 1)
        w[:, e % k] *= 20  # an outlier input channel per expert
        t = [0, 1, 17, 40][e % 4]  # token counts differ (one expert got none)
        x = torch.randn(t, k, generator=g) * (1 + 5 * torch.rand(k, generator=g))
        out.append(awq.Member(f"model.layers.1.mlp.experts.{e}.down_proj", w, spec, x))
    return out


def test_batched_expert_search_equals_the_sequential_one():
    opts = AWQOptions(grid=8)
    members = _experts(11, 48, 64)
    want = [awq.search_scales([m], opts, torch.float16) for m in members]
    for chunk in (1, 4, 16):
        got = awq.search_scales_experts(members, opts, torch.float16, chunk=chunk)
        for e, (a, b) in enumerate(zip(want, got)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=0, msg=f"expert {e}, chunk {chunk}")
    assert not torch.equal(want[1], torch.ones(64))  # the search moved off the identity
    assert torch.equal(want[0], torch.ones(64))  # no tokens: identity, as search_scales gives


def _clip_cases(n_lin: int, n: int, k: int, seed: int = 1):
    """Weights whose group scales span three orders of magnitude with outlier rows and columns,
    inputs with per-channel scales; one Linear got no rows, two share one input tensor."""
    g = torch.Generator().manual_seed(seed)
    ws, xs = [], []
    for i in range(n_lin):
        w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, k // 32).repeat_interleave(32)[None]
        w[i % n] *= 30
        w[:, (7 * i) % k] *= 15
        ws.append(w)
        t = [0, 9, 33, 50][i % 4]
        xs.append(torch.randn(t, k, generator=g) * (1 + 5 * torch.rand(k, generator=g)))
    xs[3] = xs[2]  # gate and up: one tensor
    return ws, xs


def test_batched_expert_clip_search_equals_the_sequential_one():
    opts = AWQOptions(clip_grid=10)
    spec = SchemeSpec("awq", bits=4, group_size=32)
    ws, xs = _clip_cases(9, 40, 128)
    want = [awq.search_clip(x, w, spec, opts, torch.float16) for x, w in zip(xs, ws)]
    members = [awq.Member(f"m{i}", w, spec, x, "m2" if i == 3 else "") for i, (w, x) in enumerate(zip(ws, xs))]
    for batch_bytes in (1, 3 * 5 * 4 * 40 * 128, 1 << 30):  # one Linear a batch, three, all
        got = awq.search_clip_experts(members, opts, torch.float16, batch_bytes=batch_bytes)
        assert len(got) == len(ws)
        for i, (a, b) in enumerate(zip(want, got)):
            same = (a == b).float().mean().item()
            assert same >= 0.99, f"Linear {i}, batch {batch_bytes}: {same:.3f} of the ratios agree"
        if batch_bytes == 1:  # one Linear a batch: the one-Linear search, bitwise
            assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert torch.equal(want[0], torch.ones(40, 4))  # no rows: no clipping
    assert (want[1] < 1).any()  # the search clipped somewhere


def test_fake_int_is_int_grid_bitwise():
    from dsquant.calibrate.quantizers import fake_int, int_grid

    spec = SchemeSpec("awq", bits=4, group_size=32)
    ws, _ = _clip_cases(4, 24, 96, seed=3)
    ws[1][:, :32] = ws[1][:, :32].abs()  # groups with no negative weight
    ws[2][5, 32:64] = 0  # an all-zero group
    for w in ws:
        for scale_dtype in (torch.float16, torch.bfloat16):
            for ratio in (1.0, 0.6, torch.rand(24, 3, generator=torch.Generator().manual_seed(0)) * 0.5 + 0.5):
                want = int_grid(w, spec, scale_dtype, clip_ratio=ratio).dequantized
                assert torch.equal(fake_int(w, spec, scale_dtype, clip_ratio=ratio), want)


def test_capture_keeps_rows_fed_one_tensor_once_and_equal_to_a_plain_capture():
    """Gate and up (and MLA's q_a and kv_a) get one input key and one shared tensor, equal to what
    each saw; the other Linears keep their own; take_inputs empties the capture."""
    from dsquant.assets import bundled_model_path
    from dsquant.calibrate.capture import LayerCapture
    from dsquant.models.loader import load_layer, open_model

    model_dir = bundled_model_path("dsq-tiny-v3")
    model, source = open_model(model_dir)
    load_layer(model, source, None, "cpu", torch.float32)
    load_layer(model, source, 1, "cpu", torch.float32)  # an MoE layer
    layer, prefix = model.model.layers[1], "model.layers.1"
    hidden = torch.randn(2, 16, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ctx = model.eager_context(torch.arange(16)[None])
    seen: dict[str, list[torch.Tensor]] = {}
    names = {m: f"{prefix}.{n}" for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    plain = [m.register_forward_pre_hook(lambda mod, a: seen.setdefault(names[mod], []).append(
        a[0].reshape(-1, a[0].shape[-1]).float().clone())) for m in names]
    with LayerCapture(layer, prefix, set(), max_rows=1 << 20) as data, torch.no_grad():
        layer(hidden, ctx)
    for h in plain:
        h.remove()
    inputs = data.take_inputs(list(names.values()), "cpu")
    assert not data.rows
    for name, x in inputs.items():
        torch.testing.assert_close(x, torch.cat(seen[name]), rtol=0, atol=0, msg=name)
    e, a = f"{prefix}.mlp.experts.0", f"{prefix}.self_attn"
    pairs = [(f"{e}.gate_proj", f"{e}.up_proj"), (f"{a}.q_a_proj", f"{a}.kv_a_proj_with_mqa"),
             (f"{prefix}.mlp.shared_experts.gate_proj", f"{prefix}.mlp.shared_experts.up_proj")]
    for first, second in pairs:
        assert data.key_of(first) == data.key_of(second) == first
        assert inputs[first] is inputs[second]
    assert inputs[f"{e}.down_proj"] is not inputs[f"{e}.up_proj"]
    shared = {n for n in names.values() if data.key_of(n) != n}
    routed = {f"{prefix}.mlp.experts.{i}.up_proj" for i in range(1, len(layer.mlp.experts))
              if data.seen.get(f"{prefix}.mlp.experts.{i}.up_proj")}
    assert shared == {b for _, b in pairs} | routed and routed


def test_stacked_candidates_equal_each_members_own():
    """The gate/up group's candidates, stacked by shape in batches, are each member's Q(W s) / s."""
    ws, _ = _clip_cases(7, 40, 128, seed=5)
    ws[5] = ws[5][:24]  # another shape
    specs = [SchemeSpec("awq", 4, 32)] * 6 + [SchemeSpec("fp8_block", 8, 128)]
    members = [awq.Member(f"m{i}", w.to(torch.bfloat16), sp, torch.empty(0)) for i, (w, sp) in enumerate(zip(ws, specs))]
    s = torch.rand(128, generator=torch.Generator().manual_seed(2)) * 4 + 0.25
    want = {m.name: awq._candidate(m, s, torch.float16).to(m.weight.dtype) for m in members}
    for batch_bytes in (1, 2 * 3 * 4 * 40 * 128, 1 << 30):
        got = awq._stacked_candidates(members, s, torch.float16, batch_bytes=batch_bytes)
        assert list(got) == list(want)
        for name in want:
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], want[name]), name


def test_x_mean_streamed_over_members_matches_the_concatenation(monkeypatch):
    """Beyond CONCAT_BYTES the mean |x| runs member by member (shared inputs counted per member)."""
    ws, xs = _clip_cases(6, 8, 64, seed=7)
    spec = SchemeSpec("awq", bits=4, group_size=32)
    members = [awq.Member(f"m{i}", w, spec, x, "m2" if i == 3 else "") for i, (w, x) in enumerate(zip(ws, xs))]
    want = awq._x_mean(members)
    monkeypatch.setattr(awq, "CONCAT_BYTES", 0)
    torch.testing.assert_close(awq._x_mean(members), want, rtol=1e-6, atol=0)
