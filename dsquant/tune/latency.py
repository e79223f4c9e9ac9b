"""Latency model of a recipe: per-Linear kernel times at the model's shapes, plus fixed per-step work.

Linear times: each (scheme, N, K, M) is timed through the runtime's own quantized-linear method
objects (runtime/layers/quant.py: on CUDA the Triton W4A16 / FP8 kernels, on CPU the torch path the
server runs: a weight dequantized once at load, FP8 with its per-call activation round trip), on
random weights of that shape, median of repeats. On CPU the runtime runs an INT4 Linear as the dense
matmul of its weight dequantized at load, the very op BF16 runs, so awq entries take BF16's time there
(timing both would only rank noise); FP8 is timed, its activation round trip costs.
`cpu_mode="dequant"` instead times on CPU a weight dequantized on every call before the matmul (a
weight-only kernel's work done in torch), a CPU figure in which INT4 and FP8 cost more than BF16. A recorded table
(`--latency-table FILE`, e.g. timed on a GPU) replaces the timing; measured tables are cached in
~/.cache/dsquant/latency/<device name>-<dsquant version>.json and only missing entries are timed.

Routed experts at batch M: on CUDA, where the runtime runs a layer's experts as one fused MoE, one
entry per layer shape and scheme times that fused_moe call for M tokens routed uniformly at random
(timing.time_moe; table scheme "moe_e{E}_k{k}_{gate/up scheme}_{down scheme}", n = I, k = H). On CPU,
where the runtime loops over the experts hit, the expected number of distinct experts hit,
a = E (1 - (1 - k/E)^M), each runs ceil(M k / a) tokens; an expert projection costs a / E times its
time at that token count. Shared experts count as a dense MLP; on CUDA the runtime folds them into
the fused MoE when they share the routed experts' format, which the fixed work then absorbs.

Fixed work (attention, norms, routing, embeddings, lm_head, sampling, engine overhead): chosen as
"time a BF16 decode step with the runtime and subtract the linears": the BF16 model's TPOT (batch 1)
and its batch-B step time (B / throughput) from validate's measure_latency, minus the predicted
BF16 linear time at that M. It is model-specific and cached per model (config hash). A recorded
table may carry it as "fixed_us": {"1": us, "64": us}; without it the fixed part is 0 (noted).

Host floor (CUDA): the engine launches step N + 1 while the GPU runs step N (async scheduling), so a
decode step costs about max(host work, GPU time), not their sum; on a small model the host's share
is most of the step, and faster kernels buy nothing. The BF16 timing also splits each decode step
(LatencySpec.split_steps: the host's own work, and the GPU time of the forward and sampling by CUDA
events). The side that bounds the BF16 step gets its measured wall time W: host-bound (host >= GPU),
host[M] = W and fixed[M] = GPU - BF16 Linears; GPU-bound, host[M] = host and fixed[M] = W - BF16
Linears. A recipe's step is then max(host[M], fixed[M] + its Linears), which gives W back for BF16.
Without a split (CPU, where the host runs the forward itself, or a table without "host_us") the
host floor is 0 and the step is fixed[M] + Linears.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsquant.errors import DsquantError
from dsquant.tune.space import Group, Space, Unit, scheme_key
from dsquant.tune.timing import time_linear, time_moe

CACHE_DIR = Path("~/.cache/dsquant/latency")


@dataclass
class LatencyTable:
    device: str
    linears: dict[tuple[str, int, int, int], float] = field(default_factory=dict)  # (scheme, N, K, M) -> us
    fixed: dict[int, float] = field(default_factory=dict)  # M -> us per decode step (this model)
    host: dict[int, float] = field(default_factory=dict)  # M -> the host's floor per decode step, us
    source: str = "measured"  # "measured", "cache: PATH" or the --latency-table path
    notes: list[str] = field(default_factory=list)
    fused_moe: bool = False  # routed experts timed as one fused_moe per layer (CUDA), not per expert


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {cpu}"


def model_id(model_dir: str) -> str:
    digest = hashlib.sha256(Path(model_dir, "config.json").read_bytes()).hexdigest()[:12]
    return f"{Path(model_dir).resolve().name}@{digest}"


def cache_path(cache_dir: str | Path, device: str, cpu_mode: str) -> Path:
    from dsquant import __version__

    name = re.sub(r"[^A-Za-z0-9._-]+", "_", device_name(device)).strip("_")
    suffix = "-dequant" if device != "cuda" and cpu_mode == "dequant" else ""
    return Path(cache_dir).expanduser() / f"{name}{suffix}-{__version__}.json"


def load_table(path: str | Path, model: str) -> LatencyTable:
    """A JSON table: {"device", "linears": [{"scheme", "n", "k", "m", "us"}], "fixed_us": {M: us} or
    {model id: {M: us}}}."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
        linears = {(r["scheme"], int(r["n"]), int(r["k"]), int(r["m"])): float(r["us"]) for r in raw["linears"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DsquantError(f"{path}: not a latency table ({type(e).__name__}: {e}); expected JSON with "
                           '"linears": [{"scheme": "awq_g128", "n": N, "k": K, "m": M, "us": microseconds}, ...]'
                           ) from None
    fixed_raw = raw.get("fixed_us") or {}
    if model in fixed_raw and isinstance(fixed_raw[model], dict):
        fixed_raw = fixed_raw[model]
    fixed = {int(m): float(us) for m, us in fixed_raw.items() if not isinstance(us, dict)}
    host_raw = raw.get("host_us") or {}
    if model in host_raw and isinstance(host_raw[model], dict):
        host_raw = host_raw[model]
    host = {int(m): float(us) for m, us in host_raw.items() if not isinstance(us, dict)}
    fused = bool(raw.get("fused_moe", any(s.startswith("moe_") for s, *_ in linears)))
    return LatencyTable(str(raw.get("device", "unknown")), linears, fixed, host, str(path), fused_moe=fused)


def save_table(table: LatencyTable, path: Path, model: str) -> None:
    """Merge this model's fixed times and every linear into the cache file (temp file, then rename)."""
    old = {}
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = {}
    fixed = old.get("fixed_us") if isinstance(old.get("fixed_us"), dict) else {}
    fixed[model] = {str(m): us for m, us in sorted(table.fixed.items())}
    host = old.get("host_us") if isinstance(old.get("host_us"), dict) else {}
    host[model] = {str(m): us for m, us in sorted(table.host.items())}
    rows = {(r["scheme"], r["n"], r["k"], r["m"]): r["us"] for r in old.get("linears", [])}
    rows.update(table.linears)
    payload = {"device": table.device, "linears": [{"scheme": s, "n": n, "k": k, "m": m, "us": us}
                                                   for (s, n, k, m), us in sorted(rows.items())],
               "fixed_us": fixed, "host_us": host, "fused_moe": table.fused_moe}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


def expert_load(space: Space, m: int) -> tuple[float, int]:
    """(expected distinct experts hit, tokens per hit expert) for a batch of m tokens."""
    e, k = space.n_experts, space.top_k
    active = e * (1 - (1 - k / e) ** m)
    return active, max(1, math.ceil(m * k / active))


def module_terms(space: Space, module: str, m: int) -> tuple[int, float]:
    """(token count the module's GEMM runs at, how many times per step) for a batch of m tokens."""
    if ".mlp.experts." in module:
        active, per_expert = expert_load(space, m)
        return per_expert, active / space.n_experts
    return m, 1.0


def moe_key(space: Space, group: Group, scheme: str, m: int) -> tuple[str, int, int, int]:
    """The table key of a routed_experts group's fused MoE under `scheme` at m tokens."""
    gate = next(x for x in group.modules if x.endswith(".gate_proj"))
    down = next(x for x in group.modules if x.endswith(".down_proj"))
    inter, hidden = space.shapes[gate]
    keys = "_".join(scheme_key(space.spec(scheme, x)) for x in (gate, down))
    return f"moe_e{space.n_experts}_k{space.top_k}_{keys}", inter, hidden, m


def _moe_schemes(name: str) -> tuple[str, str]:
    """'moe_e16_k4_awq_g128_fp8_block' -> ('awq_g128', 'fp8_block')."""
    rest = name.split("_", 3)[3]
    for a in ("bf16", "fp8_block") + tuple(f"awq_g{g}" for g in (32, 64, 128)):
        if rest.startswith(a + "_"):
            return a, rest[len(a) + 1:]
    raise DsquantError(f"latency table: cannot read the schemes of {name!r}")


def needed_keys(space: Space, batches: list[int], fused_moe: bool = False) -> set[tuple[str, int, int, int]]:
    keys = set()
    for scheme, specs in space.resolved.items():
        for g in space.groups:
            if g.name == "routed_experts" and fused_moe:
                keys.update(moe_key(space, g, scheme, b) for b in batches)
                continue
            for module in g.modules:
                n, k = space.shapes[module]
                spec = specs[module]
                keys.update((scheme_key(spec), n, k, module_terms(space, module, b)[0]) for b in batches)
    return keys


def linear_step_us(space: Space, choice: dict[str, str], table: LatencyTable, m: int) -> float:
    """Predicted time of every decoder-layer Linear in one step of m tokens under `choice`."""
    return sum(unit_us(space, u, choice[u.key], table, m) for u in space.units)


def unit_us(space: Space, unit: Unit, scheme: str, table: LatencyTable, m: int) -> float:
    total = 0.0
    for g in unit.groups:
        if g.name == "routed_experts" and table.fused_moe:
            key = moe_key(space, g, scheme, m)
            if key not in table.linears:
                raise DsquantError(f"{table.source}: no fused-MoE time {key[0]} at I={key[1]}, H={key[2]}, "
                                   f"M={m} (layer {g.layer}); the table needs every layer shape's experts")
            total += table.linears[key]
            continue
        for module in g.modules:
            n, k = space.shapes[module]
            tokens, times = module_terms(space, module, m)
            key = (scheme_key(space.spec(scheme, module)), n, k, tokens)
            if key not in table.linears:
                raise DsquantError(f"{table.source}: no time for scheme {key[0]} at N={n}, K={k}, M={tokens} "
                                   f"({module}); the table needs every (scheme, N, K, M) of the model's Linears")
            total += table.linears[key] * times
    return total


def build_table(space: Space, batches: list[int], device: str, model_dir: str, table_path: str | None,
                cache_dir: str | Path, cpu_mode: str, fixed_spec, log=print) -> LatencyTable:
    """The latency table: a recorded one (--latency-table), else the cache topped up by timing."""
    model = model_id(model_dir)
    steps = getattr(fixed_spec, "num_scheduler_steps", 1)
    if steps > 1:  # the fixed work and host floor of a multi-step engine are its own
        model += f" num_scheduler_steps={steps}"
    if table_path is not None:
        table = load_table(table_path, model)
        needed = needed_keys(space, batches, table.fused_moe)
        missing = sorted(needed - set(table.linears))
        if missing:
            s, n, k, m = missing[0]
            raise DsquantError(f"{table_path}: no time for scheme {s} at N={n}, K={k}, M={m} ({len(missing)} "
                               "entries missing); the table needs every (scheme, N, K, M) of the model's Linears")
        if not all(b in table.fixed for b in batches):
            table.notes.append(f"{table_path} has no fixed_us for every batch size: the fixed per-step work "
                               "counts as 0 where missing, so TPOT is predicted from the Linears alone")
        return table
    path = cache_path(cache_dir, device, cpu_mode)
    table = load_table(path, model) if path.is_file() else LatencyTable(device_name(device))
    table.source = f"cache {path}" if table.linears else "measured"
    table.fused_moe = device == "cuda" and space.n_experts > 0
    todo = sorted(needed_keys(space, batches, table.fused_moe) - set(table.linears))
    if todo:
        log(f"latency: timing {len(todo)} linear shapes on {device_name(device)}")
    for s, n, k, m in sorted(todo, key=lambda key: key[0] != "bf16"):  # BF16 first: INT4 on CPU copies it
        if s.startswith("moe_"):
            key_13, key_2 = _moe_schemes(s)
            table.linears[(s, n, k, m)] = time_moe(key_13, key_2, space.n_experts, space.top_k, n, k, m)
        elif device != "cuda" and cpu_mode == "runtime" and s.startswith("awq_g"):
            table.linears[(s, n, k, m)] = table.linears[("bf16", n, k, m)]
        else:
            table.linears[(s, n, k, m)] = time_linear(s, n, k, m, device, cpu_mode)
    if not all(b in table.fixed for b in batches):
        log("latency: timing a BF16 decode step of the model (fixed per-step work)")
        fixed, host = measure_fixed(space, batches, device, model_dir, table, fixed_spec)
        table.fixed.update(fixed)
        table.host.update(host)
    save_table(table, path, model)
    return table


def measure_fixed(space: Space, batches: list[int], device: str, model_dir: str, table: LatencyTable,
                  spec) -> tuple[dict[int, float], dict[int, float]]:
    """(fixed, host floor) per batch size from a BF16 decode timing with the runtime (module docstring)."""
    from dsquant.validate.latency import measure_latency

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    result = measure_latency(model_dir, device, spec, dtype=dtype)
    bf16 = {u.key: "bf16" for u in space.units}
    fixed, host = {}, {}
    for b in batches:
        step = result.tpot_s * 1e6 if b == 1 else b / result.throughput_tok_s[b] * 1e6
        fixed[b], host[b] = split_fixed(step, result.decode_split.get(b), linear_step_us(space, bf16, table, b))
        if fixed[b] < 0:
            table.notes.append(f"batch {b}: the BF16 step's GPU-side work ({fixed[b] + linear_step_us(space, bf16, table, b):.0f} "
                               "us) is shorter than its timed Linears; fixed work clamped to 0")
            fixed[b] = 0.0
    return fixed, host


def split_fixed(step_us: float, split: dict | None, bf16_linear_us: float) -> tuple[float, float]:
    """(fixed, host floor) of a measured BF16 step of step_us whose decode split is `split`
    ({"host_us", "gpu_us"}, or None): the side that bounds the step gets its wall time."""
    if not split or not math.isfinite(split.get("gpu_us", math.nan)):
        return step_us - bf16_linear_us, 0.0
    if split["host_us"] >= split["gpu_us"]:
        return split["gpu_us"] - bf16_linear_us, step_us
    return step_us - bf16_linear_us, split["host_us"]


def predict(space: Space, choice: dict[str, str], table: LatencyTable, batches: list[int]) -> dict:
    """{"step_us": {B: us}, "linear_us": {B: us}, "throughput_tok_s": {B: tokens/s}} of a recipe:
    step = max(host floor, fixed + Linears) (module docstring)."""
    linear = {b: linear_step_us(space, choice, table, b) for b in batches}
    steps = {b: max(table.host.get(b, 0.0), table.fixed.get(b, 0.0) + linear[b]) for b in batches}
    return {"step_us": steps, "linear_us": linear, "throughput_tok_s": {b: b / us * 1e6 for b, us in steps.items()}}
