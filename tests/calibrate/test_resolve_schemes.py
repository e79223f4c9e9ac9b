"""Scheme resolution from shapes (calibrate/resolve.py), modules_to_not_convert names (export/codecs.py)
and the expert-coverage stats and warning (models/manifest.py), without running a model."""
import pytest

from dsquant.calibrate.export_format import choose_format
from dsquant.calibrate.recipe import SchemeSpec, parse_recipe
from dsquant.calibrate.resolve import resolve_schemes
from dsquant.errors import ConfigError
from dsquant.export.codecs import not_convert_names
from dsquant.models.manifest import coverage_warning, expert_coverage, fold_names

SHAPES = {  # full name -> (out_features N, in_features K)
    "model.layers.0.mlp.down_proj": (2048, 10944),  # V2-Lite's dense down_proj: 64 x 171
    "model.layers.0.self_attn.q_proj": (3072, 576),  # hidden 576: 64 x 9
    "model.layers.0.self_attn.kv_b_proj": (4096, 96),  # 32 x 3
    "model.layers.0.self_attn.q_b_proj": (128, 80),  # no 32
    "model.layers.0.self_attn.odd_rows": (84, 128),  # N not a multiple of 8
    "model.layers.1.mlp.down_proj": (2048, 1408),  # divisible
    "model.layers.1.self_attn.o_proj": (2048, 80),  # FP8: any K
}


def recipe(group=128, mode=None):
    raw = {"default": {"scheme": "awq", "group_size": group},
           "rules": [{"match": "*.o_proj", "scheme": "fp8_block"}]}
    if mode is not None:
        raw["on_indivisible"] = mode
    return parse_recipe(raw, "r.yaml")


def test_fallback_takes_the_largest_smaller_group_that_divides_else_bf16():
    got = resolve_schemes(SHAPES, recipe())
    assert {n: (s.scheme, s.group_size) if s.is_int else s.scheme for n, s in got.specs.items()} == {
        "model.layers.0.mlp.down_proj": ("awq", 64), "model.layers.0.self_attn.q_proj": ("awq", 64),
        "model.layers.0.self_attn.kv_b_proj": ("awq", 32), "model.layers.0.self_attn.q_b_proj": "bf16",
        "model.layers.0.self_attn.odd_rows": "bf16", "model.layers.1.mlp.down_proj": ("awq", 128),
        "model.layers.1.self_attn.o_proj": "fp8_block"}
    assert set(got.fallbacks) == {n for n in SHAPES if n.startswith("model.layers.0.")}
    assert got.fallbacks["model.layers.0.self_attn.odd_rows"].to_dict() == {
        "from": "awq g128", "to": "bf16",
        "reason": "out_features 84 is not a multiple of 8 (INT4 packs 8 rows per int32)"}
    assert got.int_groups() == {128, 64, 32}
    g64 = resolve_schemes(SHAPES, recipe(group=64))  # only smaller groups are tried: 96 -> 32, 1408 stays 64
    assert g64.specs["model.layers.0.self_attn.kv_b_proj"].group_size == 32 and "model.layers.1.mlp.down_proj" \
        not in g64.fallbacks
    g32 = resolve_schemes(SHAPES, recipe(group=32))
    assert g32.specs["model.layers.0.self_attn.q_b_proj"].scheme == "bf16" and set(g32.fallbacks) == {
        "model.layers.0.self_attn.q_b_proj", "model.layers.0.self_attn.odd_rows"}


def test_keep_leaves_every_indivisible_module_bf16_and_error_names_it():
    kept = resolve_schemes(SHAPES, recipe(mode="keep"))
    assert {n for n, s in kept.specs.items() if s.scheme == "bf16"} == set(kept.fallbacks)
    assert kept.int_groups() == {128}
    with pytest.raises(ConfigError, match=r"r\.yaml: group_size 128 does not divide in_features 10944 of "
                                          r"model\.layers\.0\.mlp\.down_proj \(on_indivisible: error"):
        resolve_schemes(SHAPES, recipe(mode="error"))


def test_on_indivisible_must_name_a_mode():
    with pytest.raises(ConfigError, match=r"r\.yaml: on_indivisible: 'pad'; expected one of fallback, keep, error"):
        recipe(mode="pad")
    assert recipe().to_dict()["on_indivisible"] == "fallback" and recipe(mode="keep").on_indivisible == "keep"


def test_one_group_formats_keep_the_other_groups_bf16():
    got = resolve_schemes(SHAPES, recipe())
    single = got.single_group("awq")
    assert single.int_groups() == {128}
    assert single.specs["model.layers.0.mlp.down_proj"] == SchemeSpec("bf16")
    assert "--format awq holds one group size (128), so not awq g64" in \
        single.fallbacks["model.layers.0.mlp.down_proj"].reason
    assert single.specs["model.layers.1.mlp.down_proj"].group_size == 128
    # every INT module fell back to one group: that group is the model's
    only = resolve_schemes({"model.layers.0.a": (64, 576), "model.layers.0.b": (64, 192)}, recipe())
    assert only.single_group("awq").int_groups() == {64}
    awq = parse_recipe({"default": {"scheme": "awq"}}, "awq.yaml")
    assert choose_format(awq, "auto", got.int_groups()) == "compressed-tensors"
    assert choose_format(awq, "awq", got.int_groups()) == "awq" and choose_format(awq, None, {64}) == "awq"
    with pytest.raises(ConfigError, match="--format gptq: not available"):
        choose_format(awq, "gptq", got.int_groups())


def test_not_convert_names_strip_a_layer_prefix_only_where_no_reader_could_mistake_it():
    quantized = ["model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj"]
    kept = ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.kv_b_proj", "model.layers.1.self_attn.kv_b_proj",
            "model.layers.0.mlp.experts.3.up_proj", "model.layers.0.self_attn.q_b_proj"]
    got = not_convert_names(kept, quantized, full={"model.layers.0.self_attn.q_b_proj"})
    assert got == ["mlp.experts.3.up_proj", "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_b_proj",
                   "self_attn.kv_b_proj"]
    # what vLLM / transformers do with the list: skip a module when an entry is a substring of its name
    for name in quantized:
        assert not any(entry in name for entry in got), name


def test_expert_coverage_and_the_ten_percent_warning():
    cov = expert_coverage([0, 10, 40, 50, 60, 70, 80, 90, 100, 110], [0, 1])
    assert {k: cov[k] for k in ("n_experts", "min", "median", "max", "n_fallback")} == {
        "n_experts": 10, "min": 0, "median": 65, "max": 110, "n_fallback": 2}
    warning = coverage_warning("4", cov)
    assert warning.startswith("layer 4: 2 of 10 experts (20%)") and "raise --n-samples" in warning
    assert coverage_warning("4", expert_coverage([5] + [100] * 9, [0])) is None  # exactly 10%: no warning
    assert expert_coverage([], []) is None and coverage_warning("0", None) is None


def test_fold_names_names_every_module_exactly():
    names = [f"model.layers.{i}.mlp.experts.{e}.down_proj" for i in (1, 2, 3, 5) for e in range(4)]
    names += ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.experts.9.up_proj",
              "model.layers.2.mlp.experts.7.up_proj"]
    assert fold_names(names) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.experts.9.up_proj",
                                 "model.layers.2.mlp.experts.7.up_proj",
                                 "model.layers.{1-3,5}.mlp.experts.{0-3}.down_proj"]


def test_act_order_gptq_stays_gptq_since_only_gptq_stores_g_idx():
    """Act-order with groups of the permuted order (static_groups: false) needs a g_idx."""
    gptq = parse_recipe({"default": {"scheme": "gptq"}, "gptq": {"act_order": True, "static_groups": False}}, "g.yaml")
    assert choose_format(gptq, "auto", {128, 64}) == "gptq" and choose_format(gptq, "gptq", {128, 64}) == "gptq"
    with pytest.raises(ConfigError, match=r"--format compressed-tensors: recipe g uses act-order GPTQ"):
        choose_format(gptq, "compressed-tensors")
    mixed = parse_recipe({"default": {"scheme": "fp8_block"}, "gptq": {"act_order": True, "static_groups": False},
                          "rules": [{"match": "*.experts.*", "scheme": "gptq"}]}, "m.yaml")
    with pytest.raises(ConfigError, match=r"--format auto: recipe m uses act-order GPTQ"):
        choose_format(mixed, None)


def test_static_act_order_gptq_goes_anywhere():
    """The default act-order keeps the groups in column order (identity g_idx): every format stores it."""
    gptq = parse_recipe({"default": {"scheme": "gptq"}}, "g.yaml")
    assert gptq.gptq.act_order and gptq.gptq.static_groups
    assert choose_format(gptq, "auto", {128, 64}) == "compressed-tensors"
    assert choose_format(gptq, "compressed-tensors") == "compressed-tensors"
