"""`dsquant tune` (issue 25): the search against brute force, the recipe it writes, the latency table
and its cache, budgets nothing meets, and end-to-end runs on the bundled models (CPU, tiny sizes)."""
import itertools
import json
import math
import random

import pytest
import yaml

from dsquant.assets import bundled_model_path
from dsquant.calibrate.export_format import choose_format
from dsquant.calibrate.recipe import load_recipe
from dsquant.calibrate.resolve import linear_shapes, resolve_schemes
from dsquant.cli import main
from dsquant.models.loader import open_model
from dsquant.errors import DsquantError
from dsquant.tune import fusion
from dsquant.tune import latency as lat
from dsquant.tune.search import Option, SearchUnit, best, closest, front_2d, search
from dsquant.tune.space import SCHEMES, build_space, choice_recipe, parse_schemes, scheme_key

V3, QWEN2 = str(bundled_model_path("dsq-tiny-v3")), str(bundled_model_path("dsq-tiny-qwen2"))
FAST = ["--n-samples", "4", "--seqlen", "64", "--heldout", "2", "--awq-grid", "4"]


def run_main(capsys, args):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    captured = capsys.readouterr()
    return exit_.value.code, captured.out, captured.err


def _space(model_dir, schemes="bf16,fp8_block,awq_g128,awq_g64"):
    model, _ = open_model(model_dir)
    return build_space(model.config, linear_shapes(model), parse_schemes(schemes))


def _synthetic(seed, n_units=6, n_options=4):
    rng = random.Random(seed)
    units = []
    for u in range(n_units):
        opts = [Option("bf16", 0.0, rng.uniform(1, 2), rng.randint(800, 1000))]
        opts += [Option(f"s{j}", rng.uniform(0, 1), rng.uniform(0, 2), rng.randint(100, 900))
                 for j in range(1, n_options)]
        units.append(SearchUnit(f"u{u}", opts))
    return units


def _brute(units, max_kl, max_bytes):
    plans = []
    for idx in itertools.product(*(range(len(u.options)) for u in units)):
        opts = [u.options[j] for u, j in zip(units, idx)]
        kl, cost, nbytes = sum(o.kl for o in opts), sum(o.cost for o in opts), sum(o.bytes for o in opts)
        plans.append((kl, cost, nbytes, idx))
    feasible = [p for p in plans if p[0] <= max_kl and p[2] <= max_bytes]
    return plans, (min(feasible, key=lambda p: (p[1], p[2], p[0])) if feasible else None)


@pytest.mark.parametrize("seed", range(6))
def test_search_finds_the_brute_force_optimum(seed):
    units = _synthetic(seed)
    for max_kl, max_bytes in ((math.inf, math.inf), (1.0, math.inf), (0.6, 3500), (2.0, 2500), (0.05, 5000)):
        plans, want = _brute(units, max_kl, max_bytes)
        got = best(search(units, max_kl, max_bytes))
        if want is None:
            assert got is None, (max_kl, max_bytes)
            continue
        assert got is not None and got.kl <= max_kl and got.bytes <= max_bytes
        assert math.isclose(got.cost, want[1], rel_tol=1e-12), (max_kl, max_bytes)
    # the unconstrained front in (kl, cost) is exactly the brute-force one
    plans, _ = _brute(units, math.inf, math.inf)
    brute_front, best_cost = [], math.inf
    for kl, cost, _, _ in sorted(plans, key=lambda p: (p[0], p[1])):
        if cost < best_cost:
            brute_front.append((kl, cost))
            best_cost = cost
    got_front = [(p.kl, p.cost) for p in front_2d(search(units).plans)]
    assert len(got_front) == len(brute_front)
    assert all(math.isclose(a[0], b[0]) and math.isclose(a[1], b[1]) for a, b in zip(got_front, brute_front))


def test_closest_names_the_plan_nearest_both_budgets():
    units = _synthetic(1, n_units=4)
    max_kl, max_bytes = 0.3, 1000  # every plan weighs more than 1000
    everything, _ = _brute(units, math.inf, math.inf)
    assert best(search(units, max_kl, max_bytes)) is None
    near = closest(search(units).plans, max_kl, max_bytes)  # from the front alone
    want = min(max(kl / max_kl, b / max_bytes) for kl, _, b, _ in everything)
    assert math.isclose(max(near.kl / max_kl, near.bytes / max_bytes), want)


def test_recipe_round_trips_every_units_scheme():
    space = _space(V3)
    names = list(SCHEMES)
    choice = {u.key: names[i % len(names)] for i, u in enumerate(space.units)}
    raw = choice_recipe(space, choice, "t")
    recipe = load_recipe_from(raw)
    specs = resolve_schemes(space.shapes, recipe).specs
    for u in space.units:
        for g in u.groups:
            for m in g.modules:
                assert specs[m] == space.spec(choice[u.key], m), m
    choose_format(recipe, None, {s.group_size for s in specs.values() if s.is_int})  # quantize accepts it
    uniform = choice_recipe(space, {u.key: "awq_g64" for u in space.units}, "u")
    assert all(r["match"].startswith("model.layers.*.") for r in uniform["rules"])  # one rule per group name


def load_recipe_from(raw, tmp=None):
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_recipe(str(path))


def _table(space, path, batches=(1, 64), drop=None):
    """A GPU-like table: INT4 fastest at small M, FP8 next, BF16 slowest (us ~ weight bytes)."""
    speed = {"bf16": 1.0, "fp8_block": 0.6, "awq_g128": 0.35, "awq_g64": 0.38}
    rows = [{"scheme": s, "n": n, "k": k, "m": m, "us": 2 + n * k * speed[s] / 1e4 * (1 + m / 64)}
            for s, n, k, m in sorted(lat.needed_keys(space, list(batches))) if (s, n, k, m) != drop]
    path.write_text(json.dumps({"device": "synthetic H200", "linears": rows,
                                "fixed_us": {str(b): 50.0 * b ** 0.5 for b in batches}}))
    return path


def test_latency_table_missing_entry_is_named(tmp_path, capsys):
    space = _space(V3)
    drop = sorted(lat.needed_keys(space, [1, 64]))[0]
    table = _table(space, tmp_path / "t.json", drop=drop)
    code, _, err = run_main(capsys, ["tune", V3, "-o", str(tmp_path / "o"), "--max-kl", "1",
                                     "--latency-table", str(table), "--no-proof"])
    assert code == 2 and str(table) in err and f"scheme {drop[0]} at N={drop[1]}, K={drop[2]}, M={drop[3]}" in err


def test_measured_latency_is_cached_and_reused(tmp_path, monkeypatch):
    space = _space(QWEN2, "bf16,fp8_block,awq_g128")
    calls = []
    monkeypatch.setattr(lat, "time_linear", lambda s, n, k, m, *a: calls.append((s, n, k, m)) or 10.0 + m)
    monkeypatch.setattr(lat, "measure_fixed", lambda *a: ({1: 100.0, 8: 200.0}, {1: 150.0, 8: 0.0}))
    first = lat.build_table(space, [1, 8], "cpu", QWEN2, None, tmp_path, "runtime", None, log=lambda m: None)
    assert calls and not any(s.startswith("awq") for s, *_ in calls)  # CPU runtime: INT4 runs BF16's op
    assert first.linears[("awq_g128", 256, 256, 1)] == first.linears[("bf16", 256, 256, 1)]
    n_calls = len(calls)
    again = lat.build_table(space, [1, 8], "cpu", QWEN2, None, tmp_path, "runtime", None, log=lambda m: None)
    assert len(calls) == n_calls and again.fixed == {1: 100.0, 8: 200.0} and again.source.startswith("cache")
    assert again.host == {1: 150.0, 8: 0.0}
    (cached,) = list(tmp_path.iterdir())
    assert cached.name.endswith(".json") and "CPU" in cached.name


def test_unmeetable_budget_exits_2_naming_the_closest(tmp_path, capsys):
    code, out, err = run_main(capsys, ["tune", V3, "-o", str(tmp_path / "o"), "--max-ppl-increase", "0.0001",
                                       "--max-weight-gb", "0.001", "--no-proof"])
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "closest candidate" in err and "awq_g128 everywhere" in err and "GB" in err
    assert not (tmp_path / "o").exists()


def test_tune_end_to_end_with_a_latency_table(tmp_path, capsys):
    space = _space(V3, "bf16,fp8_block,awq_g128")
    table = _table(space, tmp_path / "h200.json")
    out = tmp_path / "out"
    code, stdout, err = run_main(capsys, ["tune", V3, "-o", str(out), "--max-ppl-increase", "3", "--schemes",
                                          "bf16,fp8_block,awq_g128", "--latency-table", str(table), "--no-proof",
                                          *FAST])
    assert code == 0, err
    for name in ("recipe.yaml", "tune.json", "tune.md", "pareto.png"):
        assert (out / name).stat().st_size > 0, name
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left
    recipe = load_recipe(str(out / "recipe.yaml"))
    payload = json.loads((out / "tune.json").read_text())
    pred, uniform = payload["chosen"]["predicted"], payload["uniform"]
    assert pred["kl"] <= payload["budget"]["kl"] + 1e-12
    assert pred["step_us"]["1"] <= uniform["bf16"]["step_us"]["1"]  # never slower than not quantizing
    for s in ("fp8_block", "awq_g128"):  # a uniform recipe within the budget is never faster than the choice
        if uniform[s]["kl"] <= payload["budget"]["kl"]:
            assert pred["cost"] <= uniform[s]["cost"] + 1e-12
    # the written recipe gives each unit what tune.json says it chose
    specs = resolve_schemes(space.shapes, recipe).specs
    for u in space.units:
        for m in u.groups[0].modules:
            assert scheme_key(specs[m]) == payload["chosen"]["choice"][u.key]
    assert payload["latency_source"] == str(table) and payload["fixed_us"] == {"1": 50.0, "64": 400.0}
    # predicted step = fixed work + the table's linears
    step = lat.predict(space, payload["chosen"]["choice"], lat.load_table(table, ""), [1, 64])["step_us"]
    assert math.isclose(step[1], pred["step_us"]["1"])
    assert "Not run (--no-proof)" in (out / "tune.md").read_text()


@pytest.mark.slow
def test_tune_with_proof_on_qwen2(tmp_path, capsys):
    space = _space(QWEN2, "bf16,awq_g128")
    table = _table(space, tmp_path / "t.json", batches=(1, 4))
    out = tmp_path / "out"
    code, stdout, err = run_main(capsys, ["tune", QWEN2, "-o", str(out), "--max-ppl-increase", "5", "--schemes",
                                          "bf16,awq_g128", "--batch", "1,4", "--latency-table", str(table),
                                          "--eval-tokens", "256", "--window", "64", "--compare", "fp8-block",
                                          *FAST])
    assert code == 0, err
    payload = json.loads((out / "tune.json").read_text())
    proof = payload["proof"]
    # the compared recipe is quantized and measured in the same validate run; fp8_block is not a scheme of
    # this search, so it has no prediction
    assert (out / "compare" / "fp8-block" / "config.json").is_file()
    assert proof["compared"]["fp8-block"]["latency"]["tpot_us"] > 0 and payload["compared"]["fp8-block"] is None
    assert (out / "artifact" / "config.json").is_file() and (out / "validate" / "report.md").is_file()
    assert proof["heldout"]["kl"] >= 0 and math.isfinite(proof["eval"]["ppl_increase_pct"])
    assert proof["latency"]["tpot_us"] > 0 and proof["latency"]["throughput_tok_s"]["4"] > 0
    md = (out / "tune.md").read_text()
    assert "KL, held-out calibration tokens (additive-KL check)" in md and "TPOT batch 1, ms" in md
    assert "measured:" in stdout
    assert "## Against the compared recipes" in md and "| fp8-block |" in md and "not in the search space" in md
    assert "batch 1: tuned" in md and "fp8-block (measured TPOT" in md
    assert "fixed work re-timed by this run's BF16 baseline" in md  # the anchored prediction beside the cached one


def test_compared_recipes_are_the_uniform_plans():
    from dsquant.tune.runner import compared_plans, uniform_plans
    from dsquant.tune.space import recipe_choice

    space = _space(V3)
    units = [SearchUnit(u.key, [Option(s, float(i), float(i), i) for i, s in enumerate(u.options)])
             for u in space.units]
    got = compared_plans(space, units, ["fp8-block", "awq-w4g128"], 7)
    uniform = uniform_plans(units, ["fp8_block", "awq_g128"], 7)
    assert got["fp8-block"].choice == uniform["fp8_block"].choice
    assert got["awq-w4g128"].choice == uniform["awq_g128"].choice
    # a recipe mixing schemes inside one group (q_a fp8, kv_a bf16: one attn_in unit) is not in the space
    mixed = load_recipe_from({"name": "m", "default": {"scheme": "bf16"},
                              "rules": [{"match": "*.q_a_proj", "scheme": "fp8_block"}]})
    assert recipe_choice(space, mixed) is None


def test_fused_moe_entries_replace_the_per_expert_sum():
    space = _space(V3, "bf16,awq_g128")
    plain, fused = lat.needed_keys(space, [1, 8]), lat.needed_keys(space, [1, 8], fused_moe=True)
    moe = {k for k in fused if k[0].startswith("moe_")}
    assert moe and not any(k[0].startswith("moe_") for k in plain)
    # the routed experts alone, and with the layer's one shared expert folded in (same scheme on both)
    assert {k[0] for k in moe} == {"moe_e16_k4_bf16_bf16", "moe_e16_k4_awq_g128_awq_g128",
                                   "moe_e16_k4_s1_bf16_bf16", "moe_e16_k4_s1_awq_g128_awq_g128"}
    assert {(k[1], k[2]) for k in moe} == {(128, 256)}  # n = expert intermediate, k = hidden
    assert {k for k in fused if k[0] == "silu_mul"} == {("silu_mul", 128, 0, 1), ("silu_mul", 128, 0, 8)}
    assert fusion.parse_moe_key("moe_e16_k4_awq_g64_fp8_block") == (16, 4, 0, "awq_g64", "fp8_block")
    assert fusion.parse_moe_key("moe_e64_k6_s2_bf16_bf16") == (64, 6, 2, "bf16", "bf16")
    with pytest.raises(DsquantError, match="moe_e16_k4_int3_bf16"):
        fusion.parse_moe_key("moe_e16_k4_int3_bf16")
    table = lat.LatencyTable("synthetic", {k: 1.0 for k in fused}, fused_moe=True)
    routed = next(u for u in space.units if u.name == "routed_experts")
    assert lat.unit_us(space, routed, "awq_g128", table, 8) == 1.0  # one fused call per layer
    per_expert = lat.LatencyTable("synthetic", {k: 1.0 for k in plain})
    assert lat.unit_us(space, routed, "awq_g128", per_expert, 8) > 1.0


def test_shared_and_routed_experts_are_one_decision():
    """The runtime folds a layer's shared experts into the fused MoE only when both have one scheme;
    otherwise the shared MLP runs on its own (its Linears and a silu_mul launch). tune prices the pair
    together and searches the pairs as one unit."""
    from dsquant.tune.fusion import JOINT, choice_of, index_of
    from dsquant.tune.runner import search_units, uniform_plans
    from dsquant.tune.search import Plan
    from dsquant.tune.sensitivity import Candidate, Sensitivity

    space = _space(V3, "bf16,fp8_block,awq_g128")
    keys = lat.needed_keys(space, [1], fused_moe=True)
    plain = lat.needed_keys(space, [1])  # CPU: every Linear on its own, experts per expert
    us = {k: (3.0 if "_s1_" in k[0] else 2.0 if k[0].startswith("moe_") else 0.5 if k[0] == "silu_mul" else 1.0)
          for k in keys | plain}
    table = lat.LatencyTable("synthetic", us, {1: 10.0}, fused_moe=True, kernel_path=True)
    shared, routed = fusion.pairs(space)["L1"]
    dense_shared = {s: lat.unit_us(space, shared, s, table, 1) for s in shared.options}
    assert dense_shared["awq_g128"] == 3.0  # gate, up, down at 1.0 each
    for a in shared.options:
        for b in routed.options:
            got = fusion.experts_us(space, shared, routed, a, b, table, 1, lat.unit_us)
            assert got == (3.0 if a == b else dense_shared[a] + 0.5 + 2.0), (a, b)
    # the step sums the pairs, not the parts
    mixed = {u.key: "awq_g128" for u in space.units}
    mixed["L1:routed_experts"] = "bf16"
    uniform = {u.key: "awq_g128" for u in space.units}
    assert lat.linear_step_us(space, mixed, table, 1) - lat.linear_step_us(space, uniform, table, 1) == 3.0 + 0.5 + 2.0 - 3.0
    # attn_in (q_a and kv_a) is one GEMM of their summed outputs on the kernel path
    attn = next(u for u in space.units if u.key == "L1:attn_in")
    n = sum(space.shapes[m][0] for m in attn.groups[0].modules)
    assert ("awq_g128", n, 256, 1) in keys and lat.unit_us(space, attn, "awq_g128", table, 1) == 1.0
    assert lat.unit_us(space, attn, "awq_g128", lat.LatencyTable("cpu", us), 1) == 2.0  # CPU: two Linears
    # the search: one experts unit per MoE layer, its options the scheme pairs
    cands = [Candidate(g.layer, g.name, s, 0.01, 0.01, 0.1) for g in space.groups for s in ("fp8_block", "awq_g128")]
    units = search_units(space, Sensitivity(cands, 3.0, 64, 64, 64), table, [1])
    experts = [u for u in units if u.key.endswith(":experts")]
    assert [u.key for u in experts] == ["L1:experts", "L2:experts", "L3:experts"]
    assert not any(u.key.endswith(("shared_experts", "routed_experts")) for u in units)
    assert len(experts[0].options) == 9 and experts[0].options[0].scheme == f"bf16{JOINT}bf16"
    j = next(i for i, o in enumerate(experts[0].options) if o.scheme == f"awq_g128{JOINT}bf16")
    assert math.isclose(experts[0].options[j].kl, 0.01)  # the shared experts' KL, routed BF16
    idx = tuple(j if u is experts[0] else 0 for u in units)
    choice = choice_of(units, Plan(idx, 0.0, 0.0, 0))
    assert choice["L1:shared_experts"] == "awq_g128" and choice["L1:routed_experts"] == "bf16"
    assert set(choice) == {u.key for u in space.units} and index_of(units, choice) == idx
    plan = uniform_plans(units, ["awq_g128"], 0)["awq_g128"]
    assert all(v == "awq_g128" for v in choice_of(units, plan).values())


def test_bands_group_consecutive_layers():
    space = build_space(open_model(QWEN2)[0].config, linear_shapes(open_model(QWEN2)[0]),
                        parse_schemes("bf16,awq_g128"), band=4)
    assert [u.key for u in space.units] == ["L0-3:qkv", "L0-3:o_proj", "L0-3:mlp",
                                            "L4-5:qkv", "L4-5:o_proj", "L4-5:mlp"]
    assert [g.layer for g in space.units[0].groups] == [0, 1, 2, 3]
    choice = {u.key: ("awq_g128" if u.key.startswith("L4") else "bf16") for u in space.units}
    recipe = load_recipe_from(choice_recipe(space, choice, "b"))
    assert recipe.scheme_for("model.layers.5.mlp.down_proj").scheme == "awq"
    assert recipe.scheme_for("model.layers.3.mlp.down_proj").scheme == "bf16"


def test_quantize_calibrates_on_the_search_samples_and_never_on_the_heldout():
    from dsquant.data import calibration_samples, load_tokenizer
    from dsquant.tune.sensitivity import calibration_split

    calib, held = calibration_split(V3, 4, 2, 64, 0)
    quantize_draw = calibration_samples(load_tokenizer(V3), 4, 64, 0)  # what run_quantize draws
    assert (calib == quantize_draw).all()
    assert not any((h == c).all() for h in held for c in calib)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("key", ["bf16", "awq_g128", "awq_g64", "fp8_block"])
def test_gpu_timings_run_the_runtime_kernels(key):
    from dsquant.tune.timing import time_linear, time_moe

    assert 0 < time_linear(key, 256, 512, 1, "cuda") < 1e4
    assert 0 < time_moe(key, key, 16, 4, 128, 256, 8) < 1e4
    assert 0 < time_moe("awq_g128", "fp8_block", 16, 4, 128, 256, 8) < 1e4  # mixed: the runtime's bf16 experts
    assert 0 < time_moe(key, key, 16, 4, 128, 256, 8, n_shared=2) < 1e4  # two shared experts folded in
    from dsquant.tune.timing import time_silu_mul

    assert 0 < time_silu_mul(256, 8) < 1e4


def test_host_floor_split_and_prediction():
    # host-bound BF16 step (host 300 us >= GPU 120 us, wall 320): the host floor takes the wall time,
    # the fixed work the GPU side; faster Linears then buy nothing until the GPU side exceeds the floor
    fixed, host = lat.split_fixed(320.0, {"host_us": 300.0, "gpu_us": 120.0}, 80.0)
    assert (fixed, host) == (40.0, 320.0)
    # GPU-bound (GPU 900 >= host 300, wall 950): fixed takes the wall, the floor is the host's work
    assert lat.split_fixed(950.0, {"host_us": 300.0, "gpu_us": 900.0}, 500.0) == (450.0, 300.0)
    # no split (CPU): additive, no floor
    assert lat.split_fixed(950.0, None, 500.0) == (450.0, 0.0)
    assert lat.split_fixed(950.0, {"host_us": 1.0, "gpu_us": float("nan")}, 500.0) == (450.0, 0.0)
    space = _space(QWEN2, "bf16,fp8_block")
    keys = lat.needed_keys(space, [1])
    table = lat.LatencyTable("synthetic", {k: (2.0 if k[0] == "bf16" else 1.0) for k in keys})
    bf16 = {u.key: "bf16" for u in space.units}
    fp8 = {u.key: "fp8_block" for u in space.units}
    k_bf16 = lat.linear_step_us(space, bf16, table, 1)
    table.fixed, table.host = {1: 10.0}, {1: 10.0 + k_bf16 * 0.75}
    assert lat.predict(space, bf16, table, [1])["step_us"][1] == 10.0 + k_bf16
    p8 = lat.predict(space, fp8, table, [1])
    assert p8["linear_us"][1] == k_bf16 / 2 and p8["step_us"][1] == table.host[1]  # the floor binds
