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
~/.cache/dsquant/latency/<device name>-<dsquant version>-m<MODEL_VERSION>.json and only missing entries are timed.

Routed experts at batch M: on CUDA, where the runtime runs a layer's experts as one fused MoE, one
entry per layer shape and scheme times that fused_moe call for M tokens routed uniformly at random
(timing.time_moe; table scheme "moe_e{E}_k{k}_{gate/up scheme}_{down scheme}", n = I, k = H). On CPU,
where the runtime loops over the experts hit, the expected number of distinct experts hit,
a = E (1 - (1 - k/E)^M), each runs ceil(M k / a) tokens; an expert projection costs a / E times its
time at that token count. A layer's shared and routed experts are timed together (tune/fusion.py):
on CUDA the runtime folds the shared MLP into the fused MoE when both have one format (entry
"moe_e{E}_k{k}_s{n}_..."), and otherwise runs it as its own MLP (its Linears plus a silu_mul launch).
On the kernel path (CUDA) MLA's q (or q_a) and kv_a projections run as one GEMM of their summed
outputs when both have one format (runtime/layers/fused_linear.py): attn_in is timed as that GEMM.

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
from dsquant.tune import fusion
from dsquant.tune.space import Space, Unit, scheme_key
from dsquant.tune.timing import time_linear, time_moe, time_silu_mul

CACHE_DIR = Path("~/.cache/dsquant/latency")
MODEL_VERSION = 2  # of the latency model: a cache timed under another (its fixed work) is not reused


@dataclass
class LatencyTable:
    device: str
    linears: dict[tuple[str, int, int, int], float] = field(default_factory=dict)  # (scheme, N, K, M) -> us
    fixed: dict[int, float] = field(default_factory=dict)  # M -> us per decode step (this model)
    host: dict[int, float] = field(default_factory=dict)  # M -> the host's floor per decode step, us
    source: str = "measured"  # "measured", "cache: PATH" or the --latency-table path
    notes: list[str] = field(default_factory=list)
    fused_moe: bool = False  # routed experts timed as one fused_moe per layer (CUDA), not per expert
    kernel_path: bool = False  # the runtime's kernel path (CUDA): MLA's attn_in as one fused GEMM


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
    return Path(cache_dir).expanduser() / f"{name}{suffix}-{__version__}-m{MODEL_VERSION}.json"


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
    return LatencyTable(str(raw.get("device", "unknown")), linears, fixed, host, str(path), fused_moe=fused,
                        kernel_path=bool(raw.get("kernel_path", fused)))


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
               "fixed_us": fixed, "host_us": host, "fused_moe": table.fused_moe, "kernel_path": table.kernel_path}
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


def needed_keys(space: Space, batches: list[int], fused_moe: bool = False,
                kernel_path: bool | None = None) -> set[tuple[str, int, int, int]]:
    kernel_path = fused_moe if kernel_path is None else kernel_path
    keys = set()
    for scheme, specs in space.resolved.items():
        for g in space.groups:
            if g.name == "routed_experts" and fused_moe:
                keys.update(fusion.moe_key(space, g, scheme, b) for b in batches)
                continue
            fused = fusion.attn_in_fused(space, g, scheme) if kernel_path else None
            if fused is not None:
                keys.update((*fused, b) for b in batches)
                continue
            for module in g.modules:
                n, k = space.shapes[module]
                spec = specs[module]
                keys.update((scheme_key(spec), n, k, module_terms(space, module, b)[0]) for b in batches)
    if fused_moe:
        keys |= fusion.needed_keys(space, space.resolved, batches)
    return keys


def linear_step_us(space: Space, choice: dict[str, str], table: LatencyTable, m: int) -> float:
    """Predicted time of every decoder-layer Linear in one step of m tokens under `choice` (a band's
    shared and routed experts together: fusion.experts_us)."""
    paired = fusion.pairs(space)
    total = 0.0
    for u in space.units:
        if u.name == "shared_experts" and fusion.band(u) in paired:
            continue  # counted with its routed experts
        if u.name == "routed_experts" and fusion.band(u) in paired:
            shared = paired[fusion.band(u)][0]
            total += fusion.experts_us(space, shared, u, choice[shared.key], choice[u.key], table, m, unit_us)
        else:
            total += unit_us(space, u, choice[u.key], table, m)
    return total


def unit_us(space: Space, unit: Unit, scheme: str, table: LatencyTable, m: int) -> float:
    total = 0.0
    for g in unit.groups:
        if g.name == "routed_experts" and table.fused_moe:
            key = fusion.moe_key(space, g, scheme, m)
            if key not in table.linears:
                raise DsquantError(f"{table.source}: no fused-MoE time {key[0]} at I={key[1]}, H={key[2]}, "
                                   f"M={m} (layer {g.layer}); the table needs every layer shape's experts")
            total += table.linears[key]
            continue
        fused = fusion.attn_in_fused(space, g, scheme) if table.kernel_path else None
        if fused is not None:
            if (*fused, m) not in table.linears:
                raise DsquantError(f"{table.source}: no time for scheme {fused[0]} at N={fused[1]}, K={fused[2]}, "
                                   f"M={m} (layer {g.layer}'s q and kv_a projections as one GEMM)")
            total += table.linears[(*fused, m)]
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
        needed = needed_keys(space, batches, table.fused_moe, table.kernel_path)
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
    table.kernel_path = device == "cuda"
    todo = sorted(needed_keys(space, batches, table.fused_moe, table.kernel_path) - set(table.linears))
    if todo:
        log(f"latency: timing {len(todo)} linear shapes on {device_name(device)}")
    for s, n, k, m in sorted(todo, key=lambda key: key[0] != "bf16"):  # BF16 first: INT4 on CPU copies it
        if s.startswith("moe_"):
            n_experts, top_k, n_shared, key_13, key_2 = fusion.parse_moe_key(s)
            table.linears[(s, n, k, m)] = time_moe(key_13, key_2, n_experts, top_k, n, k, m, n_shared)
        elif s == "silu_mul":
            table.linears[(s, n, k, m)] = time_silu_mul(n, m)
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
