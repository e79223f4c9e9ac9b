"""The search space of `dsquant tune`: module groups x schemes, per layer or per band of layers.

Groups (one per decoder layer that has it), named after the modules they hold:
  MLA (DeepSeek V2/V3)   attn_in (q_a_proj or q_proj, kv_a_proj_with_mqa), q_b (q_b_proj), kv_b (kv_b_proj),
                         o_proj
  GQA (Qwen2, Llama)     qkv (q_proj, k_proj, v_proj), o_proj
  MLP                    mlp (a dense layer's gate/up/down), shared_experts, routed_experts (every routed
                         expert's gate/up/down of the layer)
Schemes: bf16, fp8_block, awq_g128, awq_g64. The router (mlp.gate), norms, embeddings and lm_head are
not Linears of a group and stay BF16 (the recipe's keep list). A unit of the search is one group name
over a band of `band` consecutive layers (band 1: per layer); every layer of a unit gets its scheme.

A scheme is resolved per module as quantize resolves it (calibrate/resolve.py, on_indivisible
fallback): awq_g128 on a Linear whose in_features 128 does not divide becomes g64, g32 or BF16. A
scheme that resolves to exactly what another scheme already gives a unit is dropped from its options.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dsquant.calibrate.recipe import Recipe, SchemeSpec
from dsquant.calibrate.resolve import resolve_schemes
from dsquant.errors import DsquantError

SCHEMES: dict[str, SchemeSpec] = {
    "bf16": SchemeSpec("bf16"),
    "fp8_block": SchemeSpec("fp8_block"),
    "awq_g128": SchemeSpec("awq", 4, 128),
    "awq_g64": SchemeSpec("awq", 4, 64),
}
KEEP = ["lm_head", "*.embed_tokens", "*.mlp.gate", "*norm"]
_MLA_ATTN = {"q_a_proj": "attn_in", "q_proj": "attn_in", "kv_a_proj_with_mqa": "attn_in",
             "q_b_proj": "q_b", "kv_b_proj": "kv_b", "o_proj": "o_proj"}
_GQA_ATTN = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o_proj"}
GROUP_ORDER = ("attn_in", "qkv", "q_b", "kv_b", "o_proj", "mlp", "shared_experts", "routed_experts")


def scheme_key(spec: SchemeSpec) -> str:
    """'bf16', 'fp8_block', 'awq_g128': the name a resolved spec has in latency tables."""
    return f"{spec.scheme}_g{spec.group_size}" if spec.is_int else spec.scheme


def parse_schemes(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in SCHEMES]
    if bad or not names:
        raise DsquantError(f"--schemes {text}: {bad[0] if bad else 'empty'} is not a scheme; expected a "
                           f"comma-separated subset of {', '.join(SCHEMES)}")
    return (["bf16"] if "bf16" not in names else []) + names  # BF16 is always an option


@dataclass(frozen=True)
class Group:
    """One group of one decoder layer."""

    layer: int
    name: str  # GROUP_ORDER
    modules: tuple[str, ...]  # full Linear names, e.g. model.layers.1.self_attn.q_b_proj

    @property
    def patterns(self) -> tuple[str, ...]:
        """fnmatch patterns a recipe rule uses for it (routed experts folded into one)."""
        if self.name == "routed_experts":
            return (f"model.layers.{self.layer}.mlp.experts.*",)
        return self.modules


@dataclass
class Unit:
    """What the search decides once: one group name over a band of layers."""

    key: str  # e.g. "L1:q_b" or "L0-3:o_proj"
    name: str
    groups: list[Group]
    options: list[str] = field(default_factory=list)  # scheme names; options[0] == "bf16"


@dataclass
class Space:
    shapes: dict[str, tuple[int, int]]  # decoder-layer Linear -> (out N, in K)
    groups: list[Group]
    units: list[Unit]
    resolved: dict[str, dict[str, SchemeSpec]]  # scheme name -> module -> the spec quantize gives it
    n_experts: int  # routed experts per MoE layer (0: dense model)
    top_k: int
    n_shared: int = 0  # shared experts per MoE layer (tune/experts.py folds them into the fused MoE)

    def spec(self, scheme: str, module: str) -> SchemeSpec:
        return self.resolved[scheme][module]


def _group_name(module: str, mla: bool) -> str | None:
    parts = module.split(".")  # model.layers.{i}.{self_attn|mlp}....
    if parts[3] == "self_attn":
        return (_MLA_ATTN if mla else _GQA_ATTN).get(parts[4])
    if parts[3] == "mlp":
        if parts[4] == "experts":
            return "routed_experts"
        if parts[4] == "shared_experts":
            return "shared_experts"
        if parts[4] in ("gate_proj", "up_proj", "down_proj"):
            return "mlp"
    return None


def build_space(cfg, shapes: dict[str, tuple[int, int]], schemes: list[str], band: int = 1) -> Space:
    """Groups, units and resolved schemes of a model from its Linear shapes (resolve.linear_shapes)."""
    if band < 1:
        raise DsquantError(f"--band {band}: must be at least 1 (layers per unit)")
    by_layer: dict[tuple[int, str], list[str]] = {}
    for module in shapes:
        layer = int(module.split(".")[2])
        mla = f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa" in shapes
        name = _group_name(module, mla)
        if name is None:
            raise DsquantError(f"{module}: a Linear that no tune group holds (expected attention projections, "
                               "MLP or experts); the search space does not cover this architecture")
        by_layer.setdefault((layer, name), []).append(module)
    groups = [Group(layer, name, tuple(mods)) for (layer, name), mods in
              sorted(by_layer.items(), key=lambda kv: (kv[0][0], GROUP_ORDER.index(kv[0][1])))]
    resolved = {}
    for s in schemes:
        recipe = Recipe(name=s, default=SCHEMES[s], keep=list(KEEP))
        resolved[s] = resolve_schemes(shapes, recipe).specs
    units: dict[tuple[int, str], Unit] = {}
    for g in groups:
        start = g.layer - g.layer % band
        end = min(start + band, cfg.num_hidden_layers) - 1
        key = f"L{start}:{g.name}" if band == 1 else f"L{start}-{end}:{g.name}"
        units.setdefault((start, g.name), Unit(key, g.name, [])).groups.append(g)
    for unit in units.values():
        seen = set()
        for s in schemes:
            got = tuple(resolved[s][m] for g in unit.groups for m in g.modules)
            if got not in seen:
                seen.add(got)
                unit.options.append(s)
    n_experts = int(cfg.raw.get("n_routed_experts") or 0)
    top_k = int(cfg.raw.get("num_experts_per_tok") or 0)
    n_shared = int(cfg.raw.get("n_shared_experts") or 0)
    return Space(shapes, groups, list(units.values()), resolved, n_experts, top_k, n_shared)


def weight_bytes(spec: SchemeSpec, n: int, k: int) -> int:
    """Bytes of one Linear's stored weight: bf16 2/param; fp8 1/param + fp32 128x128 block scales;
    INT4 1/2 per param + a bf16 scale and a 4-bit zero per group of G."""
    if spec.scheme == "bf16":
        return 2 * n * k
    if spec.scheme == "fp8_block":
        return n * k + 4 * (-(-n // 128)) * (-(-k // 128))
    groups = n * (k // spec.group_size)
    return n * k // 2 + 2 * groups + groups // 2


def unit_bytes(space: Space, unit: Unit, scheme: str) -> int:
    return sum(weight_bytes(space.spec(scheme, m), *space.shapes[m]) for g in unit.groups for m in g.modules)


def choice_recipe(space: Space, choice: dict[str, str], name: str, description: str = "") -> dict:
    """The recipe (as the YAML mapping parse_recipe reads) giving each unit its scheme.

    A group name whose every layer has one scheme becomes one rule over model.layers.*; otherwise one
    rule per layer. Default BF16, so every Linear not named by a rule stays BF16."""
    per_group: dict[str, dict[int, str]] = {}
    for unit in space.units:
        for g in unit.groups:
            per_group.setdefault(g.name, {})[g.layer] = choice[unit.key]
    rules = []
    for group_name in GROUP_ORDER:
        layers = per_group.get(group_name)
        if not layers:
            continue
        of_layer = {g.layer: g for g in space.groups if g.name == group_name}
        uniform = len(set(layers.values())) == 1
        targets = [(None, next(iter(layers.values())))] if uniform else sorted(layers.items())
        for layer, scheme in targets:
            if scheme == "bf16":
                continue
            spec = SCHEMES[scheme]
            for pattern in of_layer[min(layers) if layer is None else layer].patterns:
                rest = pattern.split(".", 3)[3]  # after model.layers.{i}.
                match = f"model.layers.{'*' if layer is None else layer}.{rest}"
                rule = {"match": match, "scheme": spec.scheme}
                if spec.is_int:
                    rule.update(bits=spec.bits, group_size=spec.group_size)
                rules.append(rule)
    return {"name": name, "description": description, "default": {"scheme": "bf16"}, "rules": rules,
            "keep": list(KEEP), "on_indivisible": "fallback"}


def recipe_choice(space: Space, recipe: Recipe) -> dict[str, str] | None:
    """The unit -> scheme choice that gives every module what `recipe` gives it (resolved as quantize
    resolves it), or None when some unit's modules get a mix no scheme of the space gives."""
    specs = resolve_schemes(space.shapes, recipe).specs
    choice = {}
    for unit in space.units:
        want = tuple(specs[m] for g in unit.groups for m in g.modules)
        found = [s for s in unit.options if tuple(space.resolved[s][m] for g in unit.groups for m in g.modules) == want]
        if not found:
            return None
        choice[unit.key] = found[0]
    return choice
