"""`dsquant tune`: space -> latency table -> measured sensitivity -> search -> recipe -> proof -> report.

The accuracy budget is a KL budget on the held-out calibration tokens. --max-ppl-increase P maps to
one through the perplexity model ppl_q / ppl = exp(c * KL): c is fitted on the candidates (least
squares of their held-out NLL change on their KL, through 0) when they carry enough signal, else 1
(the NLL change a perturbation is expected to cause when the BF16 model is calibrated).
The objective is the predicted step time, averaged over the requested batch sizes relative to BF16.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from dsquant.errors import DsquantError
from dsquant.tune import fusion
from dsquant.tune.fusion import JOINT, choice_of, index_of
from dsquant.tune import latency as lat
from dsquant.tune.search import Option, Plan, SearchUnit, best, closest, front_2d, search
from dsquant.tune.sensitivity import Sensitivity, SensitivityArgs, calibration_split, measure
from dsquant.tune.space import Space, build_space, recipe_choice, unit_bytes

GB = 1e9


@dataclass
class TuneArgs:
    model_dir: str
    out_dir: str
    max_ppl_increase: float | None = None  # percent
    max_kl: float | None = None  # mean nats per held-out token
    max_weight_gb: float | None = None
    batches: list[int] = field(default_factory=lambda: [1, 64])
    schemes: list[str] = field(default_factory=lambda: ["bf16", "fp8_block", "awq_g128", "awq_g64"])
    band: int = 1
    device: str = "cpu"
    latency_table: str | None = None
    latency_cache: str = str(lat.CACHE_DIR)
    cpu_latency: str = "runtime"  # "runtime" or "dequant" (latency.py)
    n_samples: int = 32
    seqlen: int = 256
    n_heldout: int = 8
    seed: int = 0
    awq_grid: int = 20
    eval_tokens: int = 8192
    window: int = 512
    proof: bool = True
    compare: list[str] = field(default_factory=lambda: ["fp8-block", "awq-w4g128"])  # quantized and measured
    # beside the chosen recipe in the proof, their predictions in tune.md
    num_scheduler_steps: int = 1  # the engine's decode steps per launch, in the fixed-work timing and the proof


def latency_spec(batches: list[int], device: str, num_scheduler_steps: int = 1):
    """The decode-dominated LatencySpec that both the fixed-work timing and the proof use: decode steps
    split into host and GPU time (the host floor, latency.py); on CUDA the proof's validate measures
    its artifacts in 3 interleaved rounds."""
    from dsquant.validate.latency import LatencySpec

    out = 128 if device == "cuda" else 16
    return LatencySpec(ttft_input=16, tpot_output=out, throughput_input=16, throughput_output=out // 2,
                       batch_sizes=tuple(b for b in batches if b > 1), repeats=5 if device == "cuda" else 2,
                       rounds=3 if device == "cuda" else 1, split_steps=True,
                       num_scheduler_steps=num_scheduler_steps)


def fixed_bytes(model, space: Space) -> int:
    """Bytes of everything outside the decoder-layer Linears (embeddings, lm_head, norms, router), BF16
    (lm_head tied to the embeddings counts once)."""
    linear = {f"{m}.weight" for m in space.shapes}
    seen, total = set(), 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in linear or (name == "lm_head.weight" and model.config.tie_word_embeddings):
            continue
        if name not in seen:
            seen.add(name)
            total += 2 * p.numel()
    return total


def ppl_coefficient(sens: Sensitivity) -> tuple[float, str]:
    pts = [(c.kl, c.dnll) for c in sens.candidates if c.kl > 1e-4]
    if len(pts) >= 5:
        c = sum(k * d for k, d in pts) / sum(k * k for k, _ in pts)
        if 0.1 <= c <= 10:
            return c, f"fitted on {len(pts)} candidates: held-out NLL change = {c:.3f} x KL"
        return 1.0, f"the fit on {len(pts)} candidates gave {c:.3f} (outside 0.1..10): c = 1 used"
    return 1.0, "too few candidates with KL > 1e-4 to fit: c = 1 (NLL change = KL)"


def search_units(space: Space, sens: Sensitivity, table: lat.LatencyTable, batches: list[int]) -> list[SearchUnit]:
    """One SearchUnit per space unit, except that a band's shared and routed experts are one unit
    "L{band}:experts" whose options are the scheme pairs "a+b" (their latency is not additive:
    tune/fusion.py)."""
    bf16 = {u.key: "bf16" for u in space.units}
    base = {b: lat.predict(space, bf16, table, batches)["step_us"][b] for b in batches}
    found = sens.lookup()

    def kl(u, s: str) -> float:
        return 0.0 if s == "bf16" else sum(found[(g.layer, g.name, s)].kl for g in u.groups)

    def share(us_at) -> float:
        return sum(us_at(b) / base[b] for b in batches) / len(batches)

    paired = fusion.pairs(space)
    units = []
    for u in space.units:
        band = fusion.band(u)
        if band in paired and u.name == "shared_experts":
            continue  # decided with the band's routed experts
        if band in paired and u.name == "routed_experts":
            shared = paired[band][0]
            options = [Option(f"{a}{JOINT}{b}", kl(shared, a) + kl(u, b),
                              share(lambda m, a=a, b=b: fusion.experts_us(space, shared, u, a, b, table, m, lat.unit_us)),
                              unit_bytes(space, shared, a) + unit_bytes(space, u, b))
                       for a in shared.options for b in u.options]
            units.append(SearchUnit(f"{band}:experts", options))
            continue
        options = [Option(s, kl(u, s), share(lambda m, s=s: lat.unit_us(space, u, s, table, m)), unit_bytes(space, u, s))
                   for s in u.options]
        units.append(SearchUnit(u.key, options))
    return units


def describe(choice: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for s in choice.values():
        counts[s] = counts.get(s, 0) + 1
    if len(counts) == 1:
        return f"{next(iter(counts))} everywhere"
    return "mixed: " + ", ".join(f"{s} x{n}" for s, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def uniform_plans(units: list[SearchUnit], schemes: list[str], fixed: int) -> dict[str, Plan]:
    """Every unit at one scheme (where a unit lacks it, BF16): the hand-picked recipes to beat."""
    out = {}
    for s in schemes:
        idx = []
        for u in units:
            have = {o.scheme: j for j, o in enumerate(u.options)}
            wants = [f"{s}{JOINT}{s}", f"bf16{JOINT}{s}", f"{s}{JOINT}bf16"] if u.key.endswith(":experts") else [s]
            idx.append(next((have[w] for w in wants if w in have), 0))
        out[s] = plan_of(units, tuple(idx), fixed)
    return out


def plan_of(units: list[SearchUnit], idx: tuple[int, ...], fixed: int = 0) -> Plan:
    opts = [u.options[j] for u, j in zip(units, idx)]
    return Plan(idx, sum(o.kl for o in opts), sum(o.cost for o in opts), fixed + sum(o.bytes for o in opts))


def compared_plans(space: Space, units: list[SearchUnit], names: list[str], fixed: int) -> dict[str, Plan | None]:
    """The plan each --compare recipe amounts to in the search space (None: not expressible in it)."""
    from dsquant.calibrate.recipe import load_recipe

    out = {}
    for name in names:
        choice = recipe_choice(space, load_recipe(name))
        if choice is None:
            out[name] = None
            continue
        out[name] = plan_of(units, index_of(units, choice), fixed)
    return out


def random_plans(units: list[SearchUnit], n: int, seed: int, fixed: int) -> list[Plan]:
    rng = random.Random(seed)
    return [plan_of(units, tuple(rng.randrange(len(u.options)) for u in units), fixed) for _ in range(n)]


def check_weight_cap(space: Space, fixed: int, max_gb: float | None) -> None:
    """Fail before any measuring when not even the smallest scheme of every unit fits the cap."""
    if max_gb is None:
        return
    smallest = {u.key: min(u.options, key=lambda s: unit_bytes(space, u, s)) for u in space.units}
    total = fixed + sum(unit_bytes(space, u, smallest[u.key]) for u in space.units)
    if total > max_gb * GB:
        raise DsquantError(f"no recipe fits --max-weight-gb {max_gb:g}: the closest candidate, {describe(smallest)}, "
                           f"weighs {total / GB:.4f} GB ({fixed / GB:.4f} GB of it embeddings, lm_head, norms and "
                           "router, which stay BF16)")


def run_tune(args: TuneArgs, log=print) -> dict:
    from dsquant.calibrate.resolve import linear_shapes
    from dsquant.models.loader import open_model
    from dsquant.tune.report import write_outputs

    if args.max_ppl_increase is None and args.max_kl is None:
        raise DsquantError("give an accuracy budget: --max-ppl-increase PERCENT or --max-kl NATS")
    for flag, v in (("--max-ppl-increase", args.max_ppl_increase), ("--max-kl", args.max_kl),
                    ("--max-weight-gb", args.max_weight_gb)):
        if v is not None and not v > 0:
            raise DsquantError(f"{flag} {v}: must be greater than 0")
    if args.cpu_latency not in ("runtime", "dequant"):
        raise DsquantError(f"--cpu-latency {args.cpu_latency}: expected runtime or dequant")
    model, _ = open_model(args.model_dir)
    space = build_space(model.config, linear_shapes(model), args.schemes, args.band)
    fixed = fixed_bytes(model, space)
    check_weight_cap(space, fixed, args.max_weight_gb)
    spec = latency_spec(args.batches, args.device, args.num_scheduler_steps)
    table = lat.build_table(space, args.batches, args.device, args.model_dir, args.latency_table,
                            args.latency_cache, args.cpu_latency, spec, log)
    sens = measure(SensitivityArgs(args.model_dir, args.n_samples, args.seqlen, args.n_heldout, args.seed,
                                   args.device, awq_grid=args.awq_grid), space, log)
    units = search_units(space, sens, table, args.batches)
    c, c_note = ppl_coefficient(sens)
    budget = math.inf
    if args.max_kl is not None:
        budget = args.max_kl
    if args.max_ppl_increase is not None:
        budget = min(budget, math.log1p(args.max_ppl_increase / 100) / c)
    cap = math.inf if args.max_weight_gb is None else args.max_weight_gb * GB
    everything = search(units, fixed_bytes=fixed)
    result = search(units, budget, cap, fixed)
    chosen = best(result)
    if chosen is None:
        near = closest(everything.plans, budget, cap)
        raise DsquantError(f"no recipe meets the budget (KL <= {budget:.3g} on held-out tokens"
                           + (f", weights <= {args.max_weight_gb:g} GB" if cap < math.inf else "")
                           + f"); the closest candidate is {describe(choice_of(units, near))}: predicted "
                           f"ppl +{math.expm1(c * near.kl) * 100:.3g}%, KL {near.kl:.3g}, {near.bytes / GB:.4f} GB")
    context = {"args": args, "space": space, "units": units, "table": table, "sens": sens, "c": c, "c_note": c_note,
               "budget": budget, "cap": cap, "fixed_bytes": fixed, "chosen": chosen, "result": result,
               "front": front_2d(everything.plans), "everything": everything,
               "uniform": uniform_plans(units, args.schemes, fixed),
               "compared": compared_plans(space, units, args.compare, fixed),
               "random": random_plans(units, 400, args.seed, fixed), "proof": None}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recipe_path = write_outputs(context, recipe_only=True)
    if args.proof:
        from dsquant.tune.proof import ProofArgs, run_proof

        _, heldout = calibration_split(args.model_dir, args.n_samples, args.n_heldout, args.seqlen, args.seed)
        context["proof"] = run_proof(ProofArgs(args.model_dir, str(recipe_path), out, args.n_samples, args.seqlen,
                                               args.seed, args.device, args.eval_tokens, args.window, spec),
                                     heldout, log, compare=args.compare)
    return write_outputs(context)
