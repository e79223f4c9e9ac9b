"""`dsquant quantize`: stream a checkpoint layer by layer through calibration into an artifact.

Only one decoder layer's weights are materialised at a time (host and device); the calibration
activations [n_samples, seqlen, hidden] stay on the device. Layer i is calibrated on the outputs
of the already-quantized layers before it (AWQOptions.float_inputs: of the float layers before it). After each layer its shard and the next layer's
inputs are saved, so an interrupted run resumes where it stopped with identical shards.
"""
from __future__ import annotations

import hashlib
import json
import logging
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsquant.calibrate.export_format import choose_format
from dsquant.calibrate.layer import layer_forward, quantize_layer
from dsquant.calibrate.recipe import Recipe, load_recipe
from dsquant.calibrate.resolve import ResolvedSchemes, resolve_schemes
from dsquant.errors import DsquantError
from dsquant.export import codecs
from dsquant.export.manifest import (MANIFEST, CalibrationRecord, QuantizeRun, build_manifest, config_entry,
                                     module_errors, versions)
from dsquant.export.writer import ArtifactWriter
from dsquant.models.loader import check_layer_headers, load_layer, open_model, release_layer
from dsquant.models.manifest import coverage_warning, expert_coverage

log = logging.getLogger(__name__)


@dataclass
class QuantizeArgs:
    model_dir: str
    recipe: str | Recipe  # a path or bundled name, or a Recipe (`--scheme`: calibrate/presets.py)
    out_dir: str
    calib: str | None = None
    n_samples: int = 128
    seqlen: int = 512
    seed: int = 0
    device: str = "cpu"
    force: bool = False
    batch_size: int = 8
    format: str | None = None  # None / "auto": the recipe's native format (export_format.choose_format)
    max_shard_bytes: int | None = None  # a layer's shard over this is written as several files
    calib_column: str = "text"
    calib_split: str | None = None


@dataclass
class QuantizeReport:
    out_dir: Path
    manifest: dict
    module_errors: dict[str, float] = field(default_factory=dict)


def _peak_host_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _layer_tensors(layer, prefix: str, result, fmt: str) -> dict[str, torch.Tensor]:
    """Everything a decoder layer contributes to its shard, in the export format."""
    tensors = {}
    for name, qw in result.weights.items():
        tensors.update(codecs.linear_tensors(name, qw, fmt))
    linear_weights = {f"{n}.weight" for n in result.weights}
    for sub, p in layer.named_parameters():
        full = f"{prefix}.{sub}"
        if full in linear_weights:
            continue
        dtype = torch.float32 if sub.endswith("e_score_correction_bias") else codecs.EXPORT_DTYPE
        tensors[full] = p.detach().to(dtype)
    return tensors


def run_quantize(args: QuantizeArgs, progress=None, module_progress=None) -> QuantizeReport:
    """progress(layers done, layers, stats) after each layer; module_progress(layer index, done,
    total, what) inside a layer, after each AWQ scaling group and each module (layer.quantize_layer)."""
    recipe = args.recipe if isinstance(args.recipe, Recipe) else load_recipe(args.recipe)  # fails before any work
    if args.n_samples < 1 or args.seqlen < 2:
        raise DsquantError(f"--n-samples and --seqlen must be positive (got {args.n_samples}, {args.seqlen})")
    model_dir = Path(args.model_dir)
    model, source = open_model(model_dir)
    cfg = model.config
    check_layer_headers(model, source)  # every layer against config.json before the first is quantized
    resolved = resolve_schemes(model, recipe)  # every Linear's scheme from its shape (on_indivisible: error fails)
    fmt = choose_format(recipe, args.format, resolved.int_groups())
    if fmt in ("awq", "gptq"):
        resolved = resolved.single_group(fmt)  # other groups stay BF16
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DsquantError("--device cuda: no CUDA device is available")
    compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    from dsquant.data import calibration_samples
    from dsquant.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)

    samples = calibration_samples(tokenizer, args.n_samples, args.seqlen, args.seed, source=args.calib,
                                  column=args.calib_column, split=args.calib_split)
    data_hash = hashlib.sha256(samples.numpy().tobytes()).hexdigest()
    recipe_key = recipe.to_dict()
    if recipe.on_indivisible == "fallback":  # the default: keeps older partial runs resumable
        del recipe_key["on_indivisible"]
    for later in ("sequential", "float_inputs"):  # likewise, options that came later, when off
        if not recipe_key["awq"][later]:
            del recipe_key["awq"][later]
    run_key = {"model_dir": str(model_dir.resolve()), "recipe": recipe_key, "calib_sha256": data_hash,
               "n_samples": args.n_samples, "seqlen": args.seqlen, "seed": args.seed,
               "device": device.type}
    if args.format not in (None, "auto") or args.max_shard_bytes:  # keeps older partial runs resumable
        run_key.update(format=fmt, max_shard_bytes=args.max_shard_bytes)
    writer = ArtifactWriter(args.out_dir, cfg.num_hidden_layers, run_key, args.force, args.max_shard_bytes)
    try:
        return _run_layers(args, model, source, recipe, resolved, fmt, device, compute_dtype, samples, data_hash,
                           writer, progress, module_progress)
    except BaseException:
        writer.discard_if_empty()  # a run that saved no progress leaves no OUT.partial behind
        raise


def _run_layers(args: QuantizeArgs, model, source, recipe: Recipe, resolved: ResolvedSchemes, fmt: str, device,
                compute_dtype, samples, data_hash: str, writer: ArtifactWriter, progress,
                module_progress=None) -> QuantizeReport:
    """Calibrate and write every layer from the writer's resume point, then finalize the artifact."""
    cfg, model_dir, scale_dtype = model.config, Path(args.model_dir), codecs.scale_dtype_for(fmt)
    t0 = time.time()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    load_layer(model, source, None, device, compute_dtype)
    positions = torch.arange(args.seqlen, device=device)[None]
    ctx = model.eager_context(positions)
    start = writer.next_layer
    if start > 0:
        hidden = writer.load_hidden().to(device, compute_dtype)
    else:
        with torch.no_grad():
            hidden = model.embed(samples.to(device))  # [n, T, hidden]
    for i in range(start, cfg.num_hidden_layers):
        t_layer = time.time()
        load_layer(model, source, i, device, compute_dtype)
        layer, prefix = model.model.layers[i], f"model.layers.{i}"
        inner = None if module_progress is None else (lambda d, t, what, i=i: module_progress(i, d, t, what))
        # float_inputs: the next layer calibrates on this float layer's output (AutoAWQ's practice), else on the quantized one's
        float_out = layer_forward(layer, hidden, ctx, args.batch_size) if recipe.awq.float_inputs else None
        result = quantize_layer(layer, prefix, hidden, ctx, recipe, resolved.specs, scale_dtype, args.batch_size,
                                progress=inner)
        hidden = float_out if float_out is not None else layer_forward(layer, hidden, ctx, args.batch_size)
        del float_out
        writer.write_shard(i, _layer_tensors(layer, prefix, result, fmt),
                           reserve=hidden.numel() * hidden.element_size())
        stats = {"seconds": round(time.time() - t_layer, 3), "errors": result.errors,
                 "schemes": {n: [w.spec.scheme, w.spec.group_size] for n, w in result.weights.items()},
                 "fallback_experts": result.fallback_experts,
                 "expert_tokens": expert_coverage(result.expert_tokens, result.fallback_experts),
                 "peak_host_bytes": _peak_host_bytes(),
                 "peak_device_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else 0}
        warning = coverage_warning(str(i), stats["expert_tokens"])
        if warning:
            log.warning(warning)
        writer.save_progress(i + 1, hidden, stats)
        release_layer(model, i)
        del layer, result
        if progress is not None:
            progress(i + 1, cfg.num_hidden_layers, stats)

    top = {"model.embed_tokens.weight": model.model.embed_tokens.weight, "model.norm.weight": model.model.norm.weight}
    if not cfg.tie_word_embeddings:
        top["lm_head.weight"] = model.lm_head.weight
    writer.write_shard(cfg.num_hidden_layers, {k: v.detach().to(codecs.EXPORT_DTYPE) for k, v in top.items()})

    layers = writer.state["layers"]
    schemes = {n: tuple(s) for st in layers.values() for n, s in st["schemes"].items() if s[0] != "bf16"}
    kept = sorted({n for st in layers.values() for n, s in st["schemes"].items() if s[0] == "bf16"})
    config = dict(cfg.raw)
    config["quantization_config"] = codecs.quantization_config(fmt, schemes, kept, set(resolved.fallbacks),
                                                               default_group=recipe.default.group_size,
                                                               gptq=recipe.gptq)
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    installed = versions()
    config["dsquant"] = config_entry(installed)  # serving insists on it
    calibration = CalibrationRecord(args.calib or "bundled:calibration", args.calib_column, args.calib_split,
                                    args.n_samples, args.seqlen, args.seed, data_hash)
    manifest = build_manifest(QuantizeRun(
        format=fmt, recipe=recipe.to_dict(), source_model=str(model_dir.resolve()), calibration=calibration,
        device=device.type, seconds_total=time.time() - t0, resumed_from_layer=start,
        peak_host_bytes=_peak_host_bytes(), scheme_fallbacks={n: f.to_dict() for n, f in resolved.fallbacks.items()},
        layer_stats=layers), installed)
    out = writer.finalize(config, manifest, model_dir)
    return QuantizeReport(out, json.loads((out / MANIFEST).read_text()), module_errors(layers))
