"""How the runtime fuses Linears, for tune's latency model: where a group's time is not its Linears' sum.

MLA's attention input: on the kernel path (CUDA) q (or q_a) and kv_a run as one GEMM of their summed
outputs when both have one format (runtime/layers/fused_linear.py); `attn_in_fused` gives its table key.

A MoE layer's shared and routed experts are one decision: their latency is not the sum of two parts.

On CUDA the runtime folds a layer's shared experts into its fused MoE call (runtime/layers/moe.py,
`_shared_as_experts`) when every gate/up/down projection of both has the same quantization method and the
shared MLP's intermediate is n_shared x the routed experts': then the shared MLP costs n_shared more
always-routed experts inside one launch sequence. Otherwise it runs as its own TritonGatedMLP (gate, up,
one silu_mul launch, down) beside the fused MoE. So a recipe that quantizes the shared experts and not the
routed ones (or the other way round) pays four more launches per layer, which the sum of per-Linear times
misses; and a uniform recipe pays less than the dense MLP's Linears.

This module gives tune that coupling: `pairs` finds each band's (shared, routed) units, `experts_us` the
time of one such pair under schemes (a, b) at m tokens, and `needed_keys` the latency-table entries it
reads: the fused MoE with the shared experts folded in ("moe_e{E}_k{k}_s{n}_{gate/up}_{down}", n = I,
k = H) and the silu_mul launch of an unfolded shared MLP ("silu_mul", I_shared, 0, M). Without fused MoE
(CPU: the runtime loops over the experts hit and runs the shared MLP densely) the pair's time is the sum.
"""
from __future__ import annotations

import re

from dsquant.errors import DsquantError
from dsquant.tune.search import Plan, SearchUnit
from dsquant.tune.space import Space, Unit, scheme_key

JOINT = "+"  # a search option "a+b" of a band's experts: shared experts in scheme a, routed in scheme b
_MOE = re.compile(r"moe_e(\d+)_k(\d+)(?:_s(\d+))?_(.+)")
SCHEME_KEYS = ("bf16", "fp8_block") + tuple(f"awq_g{g}" for g in (32, 64, 128))


def band(unit: Unit) -> str:
    """'L1' of 'L1:shared_experts', 'L0-3' of 'L0-3:routed_experts'."""
    return unit.key.split(":", 1)[0]


def pairs(space: Space) -> dict[str, tuple[Unit, Unit]]:
    """band -> (shared_experts unit, routed_experts unit), for the bands that have both."""
    shared = {band(u): u for u in space.units if u.name == "shared_experts"}
    return {band(u): (shared[band(u)], u) for u in space.units if u.name == "routed_experts" and band(u) in shared}


def parse_moe_key(name: str) -> tuple[int, int, int, str, str]:
    """'moe_e16_k4_s1_awq_g64_awq_g64' -> (16, 4, 1, 'awq_g64', 'awq_g64'); no '_s': 0 shared experts."""
    m = _MOE.fullmatch(name)
    if m:
        rest = m.group(4)
        for a in SCHEME_KEYS:
            if rest.startswith(a + "_") and rest[len(a) + 1:] in SCHEME_KEYS:
                return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0), a, rest[len(a) + 1:]
    raise DsquantError(f"latency table: cannot read the fused-MoE entry {name!r}; expected "
                       "moe_e{experts}_k{top_k}[_s{shared}]_{gate/up scheme}_{down scheme}")


def _proj(module: str) -> str:
    return module.rsplit(".", 1)[1]


def folds(space: Space, shared: Unit, routed: Unit, a: str, b: str) -> bool:
    """Whether the runtime folds this pair's shared experts into the fused MoE under schemes (a, b):
    each projection's resolved spec equal between the shared MLP and the routed experts, and the shared
    intermediate n_shared x the routed one (moe.py `_shared_as_experts`)."""
    if a != b or not space.n_shared:
        return False
    for gs, gr in zip(shared.groups, routed.groups):
        routed_spec = {_proj(m): space.spec(b, m) for m in gr.modules}
        for m in gs.modules:
            if routed_spec.get(_proj(m)) != space.spec(a, m):
                return False
        gate = next(m for m in gs.modules if m.endswith(".gate_proj"))
        r_gate = next(m for m in gr.modules if m.endswith(".gate_proj"))
        if space.shapes[gate][0] != space.n_shared * space.shapes[r_gate][0]:
            return False
    return True


def moe_key(space: Space, routed_group, scheme: str, m: int, n_shared: int = 0) -> tuple[str, int, int, int]:
    """The table key of a routed_experts group's fused MoE under `scheme` at m tokens (with n_shared
    folded shared experts)."""
    gate = next(x for x in routed_group.modules if x.endswith(".gate_proj"))
    down = next(x for x in routed_group.modules if x.endswith(".down_proj"))
    inter, hidden = space.shapes[gate]
    keys = "_".join(scheme_key(space.spec(scheme, x)) for x in (gate, down))
    shared = f"_s{n_shared}" if n_shared else ""
    return f"moe_e{space.n_experts}_k{space.top_k}{shared}_{keys}", inter, hidden, m


def silu_key(space: Space, shared_group, m: int) -> tuple[str, int, int, int]:
    gate = next(x for x in shared_group.modules if x.endswith(".gate_proj"))
    return "silu_mul", space.shapes[gate][0], 0, m


def needed_keys(space: Space, schemes, batches: list[int]) -> set[tuple[str, int, int, int]]:
    """The fused-MoE-with-shared and silu_mul entries the pairs read (fused MoE tables only)."""
    keys = set()
    for shared, routed in pairs(space).values():
        for b in batches:
            keys.update(silu_key(space, g, b) for g in shared.groups)
            for s in schemes:
                if folds(space, shared, routed, s, s):
                    keys.update(moe_key(space, g, s, b, space.n_shared) for g in routed.groups)
    return keys


def experts_us(space: Space, shared: Unit, routed: Unit, a: str, b: str, table, m: int, unit_us) -> float:
    """Microseconds a step of m tokens spends in this band's shared (scheme a) and routed (scheme b)
    experts; unit_us: latency.unit_us (passed in: latency imports this module)."""
    if not table.fused_moe:
        return unit_us(space, shared, a, table, m) + unit_us(space, routed, b, table, m)
    if folds(space, shared, routed, a, b):
        total = 0.0
        for g in routed.groups:
            key = moe_key(space, g, b, m, space.n_shared)
            if key not in table.linears:
                raise DsquantError(f"{table.source}: no fused-MoE time {key[0]} at I={key[1]}, H={key[2]}, M={m} "
                                   f"(layer {g.layer}, shared experts folded in); the table needs it")
            total += table.linears[key]
        return total
    silu = 0.0
    for g in shared.groups:
        key = silu_key(space, g, m)
        if key not in table.linears:
            raise DsquantError(f"{table.source}: no silu_mul time at I={key[1]}, M={m} (layer {g.layer}'s shared "
                               "experts run as their own MLP under these schemes); the table needs it")
        silu += table.linears[key]
    return unit_us(space, shared, a, table, m) + silu + unit_us(space, routed, b, table, m)


def attn_in_fused(space: Space, group, scheme: str) -> tuple[str, int, int] | None:
    """(scheme key, summed N, K) of an attn_in group that the kernel path runs as one GEMM under
    `scheme` (fused_linear.concat_linears' conditions), else None."""
    if group.name != "attn_in" or len(group.modules) != 2:
        return None
    first, second = sorted(group.modules, key=lambda m: m.endswith("kv_a_proj_with_mqa"))
    spec = space.spec(scheme, first)
    (n1, k1), (n2, k2) = space.shapes[first], space.shapes[second]
    multiple = 128 if spec.scheme == "fp8_block" else 8 if spec.is_int else 1
    if spec != space.spec(scheme, second) or k1 != k2 or n1 % multiple:
        return None
    return scheme_key(spec), n1 + n2, k1


def choice_of(units: list[SearchUnit], plan: Plan) -> dict[str, str]:
    """space unit key -> scheme of a plan (an experts pair split back into its two units)."""
    out = {}
    for u, j in zip(units, plan.choice):
        scheme = u.options[j].scheme
        if JOINT in scheme:
            band = u.key.split(":", 1)[0]
            out[f"{band}:shared_experts"], out[f"{band}:routed_experts"] = scheme.split(JOINT)
        else:
            out[u.key] = scheme
    return out


def index_of(units: list[SearchUnit], choice: dict[str, str]) -> tuple[int, ...]:
    """The plan indices of a (space unit key -> scheme) choice; a scheme a unit lacks: its first option."""
    idx = []
    for u in units:
        band = u.key.split(":", 1)[0]
        want = (f"{choice.get(f'{band}:shared_experts', 'bf16')}{JOINT}{choice.get(f'{band}:routed_experts', 'bf16')}"
                if u.key.endswith(":experts") else choice.get(u.key, "bf16"))
        idx.append(next((j for j, o in enumerate(u.options) if o.scheme == want), 0))
    return tuple(idx)
