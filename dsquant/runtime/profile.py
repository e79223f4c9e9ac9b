"""`dsquant profile ART`: a torch-profiler trace of one prefill and N decode steps, by layer type.

The engine runs eagerly (no CUDA graphs: a replayed graph hides its kernels from the profiler)
and synchronously (no async scheduling), one request (or --batch-size identical-length ones).
Forward hooks wrap each module in a `record_function` range named after its layer type, and
each engine step in a `dsq::prefill` / `dsq::decode` range; the sampler gets its own range.
Every kernel (CUDA) or operator's self time (CPU) is charged to the innermost range around it:

- attention: the attention module minus its projections (scores, softmax, paged KV, RoPE)
- mlp/moe: MLP / MoE modules minus their Linears (router, top-k, activation, fused MoE kernels)
- linear: every Linear, quantized or not (projections, experts' GEMMs when not fused, lm_head)
- norm/residual: RMSNorms and what the decoder layer does itself (residual adds, fused add-norm)
- sampler: sampling from the logits
- other: embedding, building the step's inputs, host <-> device copies, everything else
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.autograd.profiler import record_function

LAYER_TYPES = ("attention", "mlp/moe", "linear", "norm/residual", "sampler", "other")
PREFIX = "dsq::"
PHASES = ("prefill", "decode")


def layer_type(name: str, module: nn.Module) -> str | None:
    """The layer type a module's own work counts as; None for containers (no range)."""
    cls = type(module).__name__
    leaf = name.rsplit(".", 1)[-1]
    if isinstance(module, nn.Linear) or cls.endswith("Linear") or leaf == "lm_head":
        return "linear"
    if "Norm" in cls or leaf.endswith("norm"):
        return "norm/residual"
    if leaf == "self_attn" or "Attention" in cls:
        return "attention"
    if leaf in ("mlp", "shared_experts", "gate") or "MoE" in cls or "MLP" in cls or "Router" in cls:
        return "mlp/moe"
    if "DecoderLayer" in cls:
        return "norm/residual"
    return None


class _Ranges:
    """Forward pre/post hooks that open and close a record_function range per typed module."""

    def __init__(self, model: nn.Module):
        self.stack: list = []
        self.handles = []
        for name, module in model.named_modules():
            kind = layer_type(name, module)
            if kind is not None:
                self.handles.append(module.register_forward_pre_hook(self._enter(kind)))
                self.handles.append(module.register_forward_hook(self._exit))

    def _enter(self, kind: str):
        def hook(module, args):
            rf = record_function(PREFIX + kind)
            rf.__enter__()
            self.stack.append(rf)
        return hook

    def _exit(self, module, args, output):
        if self.stack:
            self.stack.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@dataclass
class KernelRow:
    phase: str
    layer_type: str
    name: str
    time_us: float = 0.0
    calls: int = 0


@dataclass
class ProfileResult:
    device: str
    time_kind: str  # "CUDA kernel time" or "CPU operator self time"
    prompt_len: int
    decode_steps: int
    batch_size: int
    totals: dict = field(default_factory=dict)  # phase -> layer type -> us
    kernels: list = field(default_factory=list)  # KernelRow, largest first
    trace: str = ""


def _ranges_of(evt) -> tuple[str | None, str | None]:
    """(phase, innermost layer type) from the event and its CPU ancestors."""
    phase = kind = None
    e = evt
    while e is not None:
        if e.name.startswith(PREFIX):
            label = e.name[len(PREFIX):]
            if label in PHASES:
                phase = phase or label
            elif kind is None:
                kind = label
        e = e.cpu_parent
    return phase, kind


def attribute(events, on_device: bool) -> tuple[dict, list[KernelRow]]:
    """Charge each kernel (or CPU op self time) to its phase and layer type."""
    totals = {p: {t: 0.0 for t in LAYER_TYPES} for p in PHASES}
    rows: dict[tuple, KernelRow] = {}
    for evt in events:
        if getattr(evt, "is_async", False) or evt.device_type != DeviceType.CPU:
            continue
        phase, kind = _ranges_of(evt)
        if phase is None:
            continue
        kind = kind if kind in LAYER_TYPES else "other"
        if on_device:
            items = [(k.name, float(k.duration)) for k in evt.kernels]
        elif evt.name.startswith(PREFIX):
            continue  # a range's own CPU time is Python, not an operator
        else:
            items = [(evt.name, float(evt.self_cpu_time_total))]
        for name, us in items:
            key = (phase, kind, name)
            row = rows.get(key) or rows.setdefault(key, KernelRow(phase, kind, name))
            row.time_us += us
            row.calls += 1
            totals[phase][kind] += us
    return totals, sorted(rows.values(), key=lambda r: -r.time_us)


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(2, vocab, (n, length), generator=g).tolist()


def run_profile(path: str, out_dir: str, device: str, prompt_len: int = 128, decode_steps: int = 16,
                batch_size: int = 1, dtype: torch.dtype | None = None) -> ProfileResult:
    from torch.profiler import ProfilerActivity, profile

    from dsquant.runtime.engine import model_runner
    from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
    from dsquant.runtime.engine.sequence import SamplingParams

    engine = LLMEngine(path, EngineConfig(
        device=device, dtype=dtype, enforce_eager=True, async_scheduling=False, enable_prefix_caching=False,
        max_num_seqs=max(batch_size, 1), max_model_len=prompt_len + decode_steps + 16,
        max_num_batched_tokens=max(2048, prompt_len * batch_size)))
    on_device = engine.device.type == "cuda"
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for p in _prompts(batch_size, min(prompt_len, 8), vocab):  # warm-up: allocator, lazy init
        engine.add_request(p, warm)
    while engine.has_unfinished():
        engine.step()

    ranges = _Ranges(engine.model)
    real_sample = model_runner.sample

    def sample(*args, **kwargs):
        with record_function(PREFIX + "sampler"):
            return real_sample(*args, **kwargs)

    model_runner.sample = sample
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    try:
        for p in _prompts(batch_size, prompt_len, vocab):
            engine.add_request(p, params)
        with profile(activities=activities) as prof:
            with record_function(PREFIX + "prefill"):
                engine.step()
            for _ in range(decode_steps):
                if not engine.has_unfinished():
                    break
                with record_function(PREFIX + "decode"):
                    engine.step()
            if on_device:
                torch.cuda.synchronize()
        while engine.has_unfinished():
            engine.step()
    finally:
        model_runner.sample = real_sample
        ranges.remove()
        engine.close()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    totals, kernels = attribute(prof.events(), on_device)
    result = ProfileResult(engine.device.type, "CUDA kernel time" if on_device else "CPU operator self time",
                           prompt_len, decode_steps, batch_size, totals, kernels, str(trace))
    (out / "profile.md").write_text(render(result, markdown=True))
    (out / "profile.json").write_text(json.dumps({
        "device": result.device, "time_kind": result.time_kind, "prompt_len": prompt_len,
        "decode_steps": decode_steps, "batch_size": batch_size, "totals_us": totals,
        "kernels": [vars(k) for k in kernels]}, indent=1))
    return result


def _table(head: list[str], rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        return ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)] + \
               ["| " + " | ".join(r) + " |" for r in rows]
    widths = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head] + rows]


def render(result: ProfileResult, markdown: bool = False, top: int = 5) -> str:
    """Per phase: time by layer type (with its share and top kernels), from `result.totals`."""
    lines = [f"{result.time_kind} on {result.device}: one prefill of {result.prompt_len} tokens x "
             f"{result.batch_size}, {result.decode_steps} decode steps (eager, no CUDA graphs)", ""]
    by_type = defaultdict(list)
    for k in result.kernels:
        by_type[(k.phase, k.layer_type)].append(k)
    for phase in PHASES:
        total = sum(result.totals[phase].values())
        steps = 1 if phase == "prefill" else max(result.decode_steps, 1)
        rows = []
        for t in LAYER_TYPES:
            us = result.totals[phase][t]
            names = ", ".join(f"{k.name[:40]} ({k.time_us / 1e3:.2f})" for k in by_type[(phase, t)][:top])
            rows.append([t, f"{us / 1e3:.3f}", f"{us / steps / 1e3:.3f}",
                         f"{100 * us / total:.1f}" if total else "-", names or "-"])
        rows.append(["total", f"{total / 1e3:.3f}", f"{total / steps / 1e3:.3f}", "100.0" if total else "-", ""])
        lines += [f"{'## ' if markdown else ''}{phase} ({steps} step{'s' if steps > 1 else ''})", ""]
        lines += _table(["layer type", "ms", "ms/step", "%", "top kernels (ms)"], rows, markdown) + [""]
    lines.append(f"trace: {result.trace} (open in chrome://tracing or https://ui.perfetto.dev)")
    return "\n".join(lines)
