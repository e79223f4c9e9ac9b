"""dsquant.json, the manifest `dsquant quantize` writes into an artifact, assembled from explicit values.

`build_manifest(QuantizeRun, versions())` gives, in this order:
  dsquant_version, format, recipe (Recipe.to_dict()), source_model (resolved path),
  calibration {source, column, split, n_samples, seqlen, seed, sha256 of the sample token ids},
  device, seconds_total, resumed_from_layer, peak_host_bytes and peak_device_bytes (the largest
  of the run's and every layer's), scheme_fallbacks {module: {"from", "to", "reason"}} sorted,
  layers {"<i>": {seconds, fallback_experts[, expert_tokens]}}, module_errors {module: error},
  versions {package: version or None};
ArtifactWriter.finalize adds "shards" {file: sha256}. config.json points at it with
`config_entry(versions)` under the "dsquant" key, which serving insists on. The readers:
models/manifest.py (quantize's summary, inspect), runtime/loader.py (shard checksums), validate.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

MANIFEST = "dsquant.json"
VERSIONED = ("dsquant", "torch", "triton", "transformers", "safetensors", "compressed-tensors")


def versions() -> dict[str, str | None]:
    """The installed version of each package in VERSIONED (None where it is not installed)."""
    out = {}
    for pkg in VERSIONED:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


@dataclass
class CalibrationRecord:
    source: str  # "bundled:calibration" or the user's source
    column: str
    split: str | None
    n_samples: int
    seqlen: int
    seed: int
    sha256: str  # of the sample token ids' bytes


@dataclass
class QuantizeRun:
    """What one quantize run did, as the manifest records it."""

    format: str  # the export format: "awq", "gptq", "fp8" or "compressed-tensors"
    recipe: dict  # Recipe.to_dict()
    source_model: str
    calibration: CalibrationRecord
    device: str  # "cpu" | "cuda"
    seconds_total: float  # of this invocation (a resumed run counts from its resume)
    resumed_from_layer: int
    peak_host_bytes: int  # this process's, at the end
    scheme_fallbacks: dict[str, dict]  # module -> SchemeFallback.to_dict()
    # ArtifactWriter.state["layers"]: "<i>" -> {seconds, errors, schemes, fallback_experts,
    # expert_tokens, peak_host_bytes, peak_device_bytes}, saved after each layer (kept across resumes)
    layer_stats: dict[str, dict]


def module_errors(layer_stats: dict[str, dict]) -> dict[str, float]:
    """Every quantized module's error, over all layers."""
    return {n: e for st in layer_stats.values() for n, e in st["errors"].items()}


def config_entry(versions: dict) -> dict:
    """config.json's "dsquant" value: the version that wrote the artifact and where its manifest is."""
    return {"version": versions["dsquant"], "manifest": MANIFEST}


def build_manifest(run: QuantizeRun, versions: dict) -> dict:
    """The dsquant.json payload (without "shards", which the writer adds)."""
    layers = run.layer_stats
    c = run.calibration
    return {
        "dsquant_version": versions["dsquant"], "format": run.format, "recipe": run.recipe,
        "source_model": run.source_model,
        "calibration": {"source": c.source, "column": c.column, "split": c.split, "n_samples": c.n_samples,
                        "seqlen": c.seqlen, "seed": c.seed, "sha256": c.sha256},
        "device": run.device, "seconds_total": round(run.seconds_total, 3),
        "resumed_from_layer": run.resumed_from_layer,
        "peak_host_bytes": max([run.peak_host_bytes] + [st["peak_host_bytes"] for st in layers.values()]),
        "peak_device_bytes": max([0] + [st["peak_device_bytes"] for st in layers.values()]),
        "scheme_fallbacks": dict(sorted(run.scheme_fallbacks.items())),
        "layers": {k: {"seconds": v["seconds"], "fallback_experts": v["fallback_experts"],
                       **({"expert_tokens": v["expert_tokens"]} if v.get("expert_tokens") else {})}
                   for k, v in layers.items()},
        "module_errors": module_errors(layers), "versions": versions,
    }
