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

Routed experts at batch M: the expected number of distinct experts hit, a = E (1 - (1 - k/E)^M), each
running ceil(M k / a) tokens; an expert projection costs a / E times its time at that token count.

Fixed work (attention, norms, routing, embeddings, lm_head, sampling, engine overhead): chosen as
"time a BF16 decode step with the runtime and subtract the linears": the BF16 model's TPOT (batch 1)
and its batch-B step time (B / throughput) from validate's measure_latency, minus the predicted
BF16 linear time at that M. It is model-specific and cached per model (config hash). A recorded
table may carry it as "fixed_us": {"1": us, "64": us}; without it the fixed part is 0 (noted).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsquant.errors import DsquantError
from dsquant.tune.space import Space, Unit, scheme_key

CACHE_DIR = Path("~/.cache/dsquant/latency")


@dataclass
class LatencyTable:
    device: str
    linears: dict[tuple[str, int, int, int], float] = field(default_factory=dict)  # (scheme, N, K, M) -> us
    fixed: dict[int, float] = field(default_factory=dict)  # M -> us per decode step (this model)
    source: str = "measured"  # "measured", "cache: PATH" or the --latency-table path
    notes: list[str] = field(default_factory=list)


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
    return LatencyTable(str(raw.get("device", "unknown")), linears, fixed, str(path))


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
    rows = {(r["scheme"], r["n"], r["k"], r["m"]): r["us"] for r in old.get("linears", [])}
    rows.update(table.linears)
    payload = {"device": table.device, "linears": [{"scheme": s, "n": n, "k": k, "m": m, "us": us}
                                                   for (s, n, k, m), us in sorted(rows.items())],
               "fixed_us": fixed}
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


def needed_keys(space: Space, batches: list[int]) -> set[tuple[str, int, int, int]]:
    keys = set()
    for scheme, specs in space.resolved.items():
        for module, spec in specs.items():
            n, k = space.shapes[module]
            for b in batches:
                keys.add((scheme_key(spec), n, k, module_terms(space, module, b)[0]))
    return keys


def _runtime_linear(key: str, n: int, k: int, device: str, dtype: torch.dtype, cpu_mode: str):
    """A runtime QuantLinear of scheme `key` with random weights [N, K], processed as the loader does."""
    from torch import nn

    from dsquant import formats
    from dsquant.runtime.layers.linear import QuantLinear
    from dsquant.runtime.layers.quant import AWQMethod, DenseMethod, FP8BlockMethod

    g = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.randn(n, k, generator=g) * 0.02  # [N, K] fp32
    if key == "bf16":
        layer = QuantLinear(DenseMethod(), "tune", k, n, False)
        layer.weight = nn.Parameter(w.to(dtype), requires_grad=False)
    elif key.startswith("awq_g"):
        group = int(key[5:])
        layer = QuantLinear(AWQMethod(group_size=group), "tune", k, n, False)
        q, s, z = formats.quantize_int_groupwise(w, group)
        for name, t in zip(("qweight", "qzeros", "scales"), formats.to_awq_tensors(q, s, z, dtype=torch.bfloat16)):
            setattr(layer, name, nn.Parameter(t, requires_grad=False))
    elif key == "fp8_block":
        layer = QuantLinear(FP8BlockMethod(), "tune", k, n, False)
        wq, ws = formats.quantize_fp8_block(w)
        layer.weight, layer.weight_scale_inv = (nn.Parameter(t, requires_grad=False) for t in (wq, ws))
    else:
        raise DsquantError(f"latency: no timing for scheme {key!r}")
    layer.compute_dtype = dtype
    layer.to(device)
    layer.method.process_weights_after_loading(layer)
    if device != "cuda" and cpu_mode == "dequant" and key != "bf16":
        method = layer.method
        return lambda x: torch.nn.functional.linear(x, method.dequantized_weight(layer, dtype))
    return layer


@torch.no_grad()
def time_linear(key: str, n: int, k: int, m: int, device: str, cpu_mode: str = "runtime",
                min_seconds: float = 0.02) -> float:
    """Median microseconds of y = x @ W^T for x [M, K] through scheme `key`'s runtime method."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    fn = _runtime_linear(key, n, k, device, dtype, cpu_mode)
    x = torch.randn(m, k, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        fn(x)
    sync()
    runs, spent = [], 0.0
    while len(runs) < 5 or (spent < min_seconds and len(runs) < 200):
        t0 = time.perf_counter()
        fn(x)
        sync()
        runs.append(time.perf_counter() - t0)
        spent += runs[-1]
    return statistics.median(runs) * 1e6


def linear_step_us(space: Space, choice: dict[str, str], table: LatencyTable, m: int) -> float:
    """Predicted time of every decoder-layer Linear in one step of m tokens under `choice`."""
    return sum(unit_us(space, u, choice[u.key], table, m) for u in space.units)


def unit_us(space: Space, unit: Unit, scheme: str, table: LatencyTable, m: int) -> float:
    total = 0.0
    for g in unit.groups:
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
    needed = needed_keys(space, batches)
    if table_path is not None:
        table = load_table(table_path, model)
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
    todo = sorted(needed - set(table.linears))
    if todo:
        log(f"latency: timing {len(todo)} linear shapes on {device_name(device)}")
    for s, n, k, m in sorted(todo, key=lambda key: key[0] != "bf16"):  # BF16 first: INT4 on CPU copies it
        if device != "cuda" and cpu_mode == "runtime" and s.startswith("awq_g"):
            table.linears[(s, n, k, m)] = table.linears[("bf16", n, k, m)]
        else:
            table.linears[(s, n, k, m)] = time_linear(s, n, k, m, device, cpu_mode)
    if not all(b in table.fixed for b in batches):
        log("latency: timing a BF16 decode step of the model (fixed per-step work)")
        table.fixed.update(measure_fixed(space, batches, device, model_dir, table, fixed_spec))
    save_table(table, path, model)
    return table


def measure_fixed(space: Space, batches: list[int], device: str, model_dir: str, table: LatencyTable,
                  spec) -> dict[int, float]:
    """BF16 decode step time from the runtime minus the predicted BF16 linears, per batch size."""
    from dsquant.validate.latency import measure_latency

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    result = measure_latency(model_dir, device, spec, dtype=dtype)
    bf16 = {u.key: "bf16" for u in space.units}
    fixed = {}
    for b in batches:
        step = result.tpot_s * 1e6 if b == 1 else b / result.throughput_tok_s[b] * 1e6
        fixed[b] = step - linear_step_us(space, bf16, table, b)
        if fixed[b] < 0:
            table.notes.append(f"batch {b}: the BF16 step ({step:.0f} us) is shorter than its timed Linears; "
                               "fixed work clamped to 0")
            fixed[b] = 0.0
    return fixed


def predict(space: Space, choice: dict[str, str], table: LatencyTable, batches: list[int]) -> dict:
    """{"tpot_us": {B: step us}, "throughput_tok_s": {B: tokens/s}} of a recipe."""
    steps = {b: table.fixed.get(b, 0.0) + linear_step_us(space, choice, table, b) for b in batches}
    return {"step_us": steps, "throughput_tok_s": {b: b / us * 1e6 for b, us in steps.items()}}
