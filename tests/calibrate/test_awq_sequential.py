"""Sequential in-layer AWQ (`awq: {sequential: true}`): the option parses, changes the artifact, and a
later scaling group's layer-output search runs on a layer whose earlier groups are already quantized;
a fold into an already-quantized producer (v_proj, up_proj) keeps its codes and the export exact.
`awq: {float_inputs: true}` passes the float layer's output on as the next layer's calibration input."""
from __future__ import annotations

import pytest
import torch

from dsquant.assets import bundled_model_path, bundled_models
from dsquant.calibrate import layer as layer_mod
from dsquant.calibrate import pipeline
from dsquant.calibrate.pipeline import QuantizeArgs, run_quantize
from dsquant.calibrate.quantizers import int_grid, rescale_rows
from dsquant.calibrate.recipe import SchemeSpec, parse_recipe
from dsquant.errors import ConfigError
from dsquant.formats.int_grid import dequantize_int_groupwise
from tests.tiny_checkpoints import write_tiny_v3

KEEP = ["lm_head", "*.embed_tokens", "*.mlp.gate", "*norm"]


def _recipe(sequential: bool):
    return parse_recipe({"name": "awq-seq", "default": {"scheme": "awq", "group_size": 64}, "keep": KEEP,
                         "awq": {"sequential": sequential, "grid": 6, "clip_grid": 6}}, "awq-seq.yaml")


def _on_grid(w: torch.Tensor) -> bool:
    """At most 16 distinct values in every 32 consecutive columns of every row: an INT4 grid of any
    group size (32, 64, 128) holds that; a float weight does not."""
    n, k = w.shape
    chunks = w.detach().float().reshape(n * k // 32, 32)
    return all(len(torch.unique(c)) <= 16 for c in chunks)


def test_sequential_parses_and_rejects_a_non_bool():
    assert parse_recipe({"default": {"scheme": "awq"}}, "r.yaml").awq.sequential is True  # the default
    assert _recipe(False).awq.sequential is False
    assert parse_recipe({"default": {"scheme": "awq"}}, "r.yaml").awq.float_inputs is False
    with pytest.raises(ConfigError, match=r"awq\.sequential: expected a bool, found 'yes'"):
        parse_recipe({"default": {"scheme": "awq"}, "awq": {"sequential": "yes"}}, "r.yaml")
    with pytest.raises(ConfigError, match=r"awq\.float_inputs: expected a bool, found 1"):
        parse_recipe({"default": {"scheme": "awq"}, "awq": {"float_inputs": 1}}, "r.yaml")


def test_rescale_rows_keeps_codes_and_divides_each_row():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 128, generator=g) * torch.logspace(-2, 1, 128)
    s = torch.rand(24, generator=g) * 4 + 0.25
    qw = int_grid(w, SchemeSpec("awq", 4, 64), torch.float16)
    out = rescale_rows(qw.compact(), s, torch.float16)
    assert torch.equal(out.q, qw.compact().q) and torch.equal(out.zeros, qw.zeros)
    assert out.scales.dtype == torch.float16
    torch.testing.assert_close(out.dequantized, qw.dequantized / s[:, None], rtol=2e-3, atol=1e-6)
    deq = dequantize_int_groupwise(out.q.to(torch.int32), out.scales.float(), out.zeros, 64)
    assert torch.equal(deq, out.dequantized)  # what an artifact reader computes


def _spy(monkeypatch):
    """Record, at every layer-output loss call, the candidates' names and which of the layer's Linears
    hold grid weights; and every (layer, result) quantize_layer returns."""
    calls, results = [], []
    real_loss, real_quantize = layer_mod.layer_output_loss, pipeline.quantize_layer

    def loss_spy(layer, linears, *a):
        loss = real_loss(layer, linears, *a)

        def wrapped(weights):
            calls.append((set(weights), {n for n, lin in linears.items() if _on_grid(lin.weight)}))
            return loss(weights)
        return wrapped

    def quantize_spy(layer, prefix, *a, **kw):
        result = real_quantize(layer, prefix, *a, **kw)
        own = dict(layer.named_modules())  # checked now: the pipeline releases the layer's weights next
        for name, qw in result.weights.items():  # every exported INT weight is the layer's, rescaled producers too
            if qw.spec.is_int:
                deq = dequantize_int_groupwise(qw.q.to(torch.int32), qw.scales.float(), qw.zeros, qw.spec.group_size)
                results.append((name, torch.equal(deq, own[name[len(prefix) + 1:]].weight.detach().float())))
        return result

    monkeypatch.setattr(layer_mod, "layer_output_loss", loss_spy)
    monkeypatch.setattr(pipeline, "quantize_layer", quantize_spy)
    return calls, results


def _models(tmp_path_factory):
    out = [("tiny-v3 (MLA, MoE)", write_tiny_v3(tmp_path_factory.mktemp("tiny_v3")))]
    if "dsq-tiny-qwen2" in bundled_models():  # GQA: v_proj -> o_proj and up_proj -> down_proj fold into a quantized producer
        out.append(("dsq-tiny-qwen2 (GQA, dense)", bundled_model_path("dsq-tiny-qwen2")))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _models(tmp_path_factory)


@pytest.mark.parametrize("sequential", [False, True])
def test_later_groups_are_searched_on_the_quantized_earlier_groups(models, sequential, tmp_path, monkeypatch):
    for label, model in models:
        calls, results = _spy(monkeypatch)
        run_quantize(QuantizeArgs(str(model), _recipe(sequential), str(tmp_path / label), n_samples=2, seqlen=64))
        assert calls, label
        earlier: set[str] = set()  # members of the layer's groups searched so far
        layer, later_groups = None, 0
        for names, on_grid in calls:
            if next(iter(names)).split(".")[2] != layer:  # model.layers.<i>.*: the next decoder layer
                earlier, layer = set(), next(iter(names)).split(".")[2]
            if earlier and not names & earlier:  # a later group's first candidate
                later_groups += 1
                if sequential:
                    assert earlier <= on_grid, (label, sorted(earlier - on_grid))
                else:
                    assert not earlier & on_grid, (label, sorted(earlier & on_grid))
            earlier |= names
        assert later_groups, label
        assert results and all(same for _, same in results), (label, [n for n, same in results if not same])


def test_sequential_changes_the_artifact(models, tmp_path):
    from safetensors.torch import load_file

    for label, model in models:
        shards = {}
        for sequential in (False, True):
            out = tmp_path / f"{label}-{sequential}"
            run_quantize(QuantizeArgs(str(model), _recipe(sequential), str(out), n_samples=2, seqlen=64))
            shards[sequential] = {p.name: load_file(p) for p in sorted(out.glob("*.safetensors"))}
        assert shards[False].keys() == shards[True].keys()
        differ = [(f, k) for f, t in shards[False].items() for k in t if not torch.equal(t[k], shards[True][f][k])]
        assert any("qweight" in k or "weight_packed" in k for _, k in differ), (label, differ[:3])


@pytest.mark.parametrize("float_inputs", [False, True])
def test_float_inputs_pass_the_float_layers_output_on(float_inputs, tmp_path, monkeypatch):
    """awq: {float_inputs: true}: layer i + 1 calibrates on float layer i's output (what the layer gave
    before it was quantized); off, on the quantized layer's output."""
    model = write_tiny_v3(tmp_path / "m")
    seen = []  # per layer: (its calibration input, its float output on it)
    real = pipeline.quantize_layer

    def spy(layer, prefix, hidden, ctx, *a, **kw):
        seen.append((hidden.clone(), pipeline.layer_forward(layer, hidden, ctx)))
        return real(layer, prefix, hidden, ctx, *a, **kw)

    monkeypatch.setattr(pipeline, "quantize_layer", spy)
    recipe = parse_recipe({"default": {"scheme": "awq", "group_size": 64}, "keep": KEEP,
                           "awq": {"float_inputs": float_inputs, "grid": 4, "clip_grid": 4}}, "r.yaml")
    run_quantize(QuantizeArgs(str(model), recipe, str(tmp_path / "out"), n_samples=2, seqlen=64))
    assert len(seen) >= 2
    for (_, float_out), (next_input, _) in zip(seen, seen[1:]):
        assert torch.equal(next_input, float_out) == float_inputs
