"""What a checkpoint holds, read from config.json and the safetensors headers (no weights loaded).

Used by `dsquant inspect`: architecture, layer mix, parameter count, and for each module type
(e.g. `self_attn.q_a_proj`, `mlp.experts.*.down_proj`) how many modules, their dtype and
format (bf16, fp8-block, int4-awq, int4-gptq, compressed-tensors packed), and for quantized
checkpoints the quantization_config (from config.json, or AutoAWQ's quant_config.json /
AutoGPTQ's quantize_config.json), its parsed INT4 scheme (formats.parse_quantization_config) and
which module types it covers; for dsquant artifacts also what dsquant.json tells of calibration:
modules that fell back from their recipe scheme, per-layer expert coverage and its warnings
(manifest.py).
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from dsquant.config import ModelConfig, load_config
from dsquant.formats import AwqConfig, GptqConfig, parse_quantization_config
from dsquant.models.causal_lm import CausalLM
from dsquant.models.checkpoint import CheckpointReader
from dsquant.models.manifest import coverage_warnings, manifest_report, read_manifest
from dsquant.models.verify import verify_checkpoint

_LAYER = re.compile(r"\blayers\.\d+\.")
_EXPERT = re.compile(r"\bexperts\.\d+\.")
PACKED_WEIGHTS = ("qweight", "weight_packed")  # int32 holding 8 int4 values each
AUX_TENSORS = ("qzeros", "scales", "g_idx", "weight_scale_inv", "weight_scale",
               "weight_zero_point", "weight_shape", "weight_g_idx", "input_scale")


@dataclass
class ModuleTypeInfo:
    count: int = 0
    params: int = 0
    formats: Counter = field(default_factory=Counter)


@dataclass
class CheckpointSummary:
    path: str
    config: ModelConfig
    num_params: int
    disk_bytes: int
    num_shards: int
    dense_layers: int
    moe_layers: int
    module_types: dict[str, ModuleTypeInfo]
    quantization: dict | None
    tensors_checked: int = 0
    quantization_source: str | None = None  # config.json, quant_config.json or quantize_config.json
    int4: AwqConfig | GptqConfig | None = None  # parsed AWQ / GPTQ config
    manifest: dict | None = None  # dsquant.json of a dsquant artifact

    def calibration_info(self) -> dict | None:
        """Shape fallbacks, per-layer expert token counts and warnings from dsquant.json (for --json)."""
        if not self.manifest:
            return None
        layers = self.manifest.get("layers") or {}
        return {"scheme_fallbacks": self.manifest.get("scheme_fallbacks") or {},
                "expert_tokens": {k: v["expert_tokens"] for k, v in layers.items() if v.get("expert_tokens")},
                "fallback_experts": {k: v["fallback_experts"] for k, v in layers.items() if v.get("fallback_experts")},
                "warnings": coverage_warnings(layers)}

    def quantization_info(self) -> dict | None:
        """Method, bits, group size, zero point, format version and source file (for --json)."""
        if not self.quantization:
            return None
        info = {"method": self.quantization.get("quant_method"), "source": self.quantization_source}
        if self.int4:
            i = self.int4
            info.update(bits=i.bits, group_size=i.group_size, zero_point=i.zero_point, sym=not i.zero_point,
                        desc_act=i.desc_act, format=i.version)
        return info

    def quantized_types(self) -> list[str]:
        return [t for t, i in self.module_types.items() if any(_is_quant(f) for f in i.formats)]

    def kept_types(self) -> list[str]:
        return [t for t, i in self.module_types.items() if not any(_is_quant(f) for f in i.formats)]


def _is_quant(fmt: str) -> bool:
    return fmt.startswith(("int", "fp8"))


def module_type(prefix: str) -> str:
    """'model.layers.3.mlp.experts.17.up_proj' -> 'mlp.experts.*.up_proj'."""
    name = prefix[len("model."):] if prefix.startswith("model.") else prefix
    return _EXPERT.sub("experts.*.", _LAYER.sub("", name))


def _format(tensors: dict[str, str], quant_method: str | None) -> str:
    """Format of one module from its tensors' {suffix: dtype}."""
    if "qweight" in tensors:
        return "int4-gptq" if quant_method == "gptq" or "g_idx" in tensors else "int4-awq"
    if "weight_packed" in tensors:
        return "int4-packed (compressed-tensors)"
    w = tensors.get("weight", "")
    if w.startswith("F8"):
        return "fp8-block" if "weight_scale_inv" in tensors else "fp8 (compressed-tensors)"
    return {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}.get(w, w.lower() or "other")


def summarize(model_dir: str | Path) -> CheckpointSummary:
    cfg = load_config(model_dir)
    reader = CheckpointReader(model_dir)
    checked = verify_checkpoint(CausalLM(cfg), reader)
    per_module: dict[str, dict[str, str]] = defaultdict(dict)
    numel: dict[str, int] = {}
    for key in reader.keys():
        prefix, _, suffix = key.rpartition(".")
        f = reader._open(reader.key_to_file[key]).get_slice(key)
        per_module[prefix][suffix] = f.get_dtype()
        n = 1
        for d in f.get_shape():
            n *= d
        if suffix in PACKED_WEIGHTS:
            numel[prefix] = numel.get(prefix, 0) + 8 * n
        elif suffix not in AUX_TENSORS:
            numel[prefix] = numel.get(prefix, 0) + n
    qcfg = cfg.quantization_config
    fmt = parse_quantization_config(qcfg, cfg.quantization_source or "config.json")
    method = fmt.method if fmt is not None else None
    types: dict[str, ModuleTypeInfo] = {}
    for prefix, tensors in sorted(per_module.items()):
        info = types.setdefault(module_type(prefix), ModuleTypeInfo())
        info.count += 1
        info.params += numel.get(prefix, 0)
        info.formats[_format(tensors, method)] += 1
    n_layers = cfg.num_hidden_layers
    moe = sum(cfg.is_moe_layer(i) for i in range(n_layers))
    return CheckpointSummary(
        path=str(model_dir), config=cfg, num_params=sum(numel.values()),
        disk_bytes=reader.total_bytes(), num_shards=len(set(reader.key_to_file.values())),
        dense_layers=n_layers - moe, moe_layers=moe, module_types=types, quantization=qcfg,
        tensors_checked=checked, quantization_source=cfg.quantization_source,
        int4=fmt if isinstance(fmt, (AwqConfig, GptqConfig)) else None,
        manifest=read_manifest(model_dir))


def human(n: float, unit: str = "") -> str:
    for suffix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.1f}{suffix}{unit}" if suffix else f"{n:.0f}{unit}"
        n /= 1000
    return f"{n:.1f}P{unit}"


def render(s: CheckpointSummary) -> str:
    """The terminal report of `dsquant inspect`."""
    c = s.config
    lines = [f"checkpoint   {s.path}",
             f"architecture {c.architecture}",
             f"layers       {c.num_hidden_layers} ({s.dense_layers} dense, {s.moe_layers} MoE)",
             f"parameters   {human(s.num_params)} ({s.num_params:,})",
             f"on disk      {human(s.disk_bytes, 'B')} in {s.num_shards} shard(s)",
             f"verified     {s.tensors_checked} weights match config.json in name, shape and dtype"]
    if c.is_deepseek:
        lines.append(f"attention    MLA: {c.num_attention_heads} heads, q_lora_rank {c.q_lora_rank}, "
                     f"kv_lora_rank {c.kv_lora_rank}, rope {c.qk_rope_head_dim} ({c.rope.rope_type})")
        if c.n_routed_experts:
            lines.append(f"experts      {c.n_routed_experts} routed (top-{c.num_experts_per_tok}, "
                         f"{c.topk_method}, {c.scoring_func}), {c.n_shared_experts} shared")
    else:
        lines.append(f"attention    GQA: {c.num_attention_heads} heads, {c.num_key_value_heads} kv heads, "
                     f"head_dim {c.dense_head_dim}, rope {c.rope.rope_type}")
    width = max(len(t) for t in s.module_types)
    lines += ["", f"{'module type':<{width}}  {'count':>6}  {'params':>9}  format"]
    for t, info in s.module_types.items():
        fmts = ", ".join(f"{f} x{n}" if len(info.formats) > 1 else f for f, n in info.formats.items())
        lines.append(f"{t:<{width}}  {info.count:>6}  {human(info.params):>9}  {fmts}")
    if s.quantization:
        q = s.quantization
        shown = {k: v for k, v in q.items() if k not in ("config_groups",)}
        lines += ["", f"quantization {q.get('quant_method')} (from {s.quantization_source or 'config.json'}): {shown}"]
        if s.int4:
            lines.append(f"  scheme:    {s.int4.describe()}")
        if "config_groups" in q:
            for name, group in q["config_groups"].items():
                lines.append(f"  group {name}: targets {group.get('targets')}, "
                             f"weights {group.get('weights')}")
        lines.append(f"  quantized: {', '.join(s.quantized_types()) or 'none'}")
        lines.append(f"  kept:      {', '.join(s.kept_types()) or 'none'}")
    else:
        lines += ["", "quantization none (dense checkpoint)"]
    calibration = manifest_report(s.manifest) if s.manifest else []
    if calibration:
        lines += ["", *calibration]
    return "\n".join(lines)
