"""Load a checkpoint or dsquant artifact for serving: checksums, quantized linears, repacking.

1. If the directory has a dsquant.json manifest with a "shards" map {filename: sha256}, every
   listed shard is hashed and a mismatch is refused, naming the shard. Without one, an artifact
   whose config.json says dsquant made it (its "dsquant" key) is refused: its manifest was lost
   and nothing vouches for its shards (verify=False, `dsquant serve --no-verify`, serves it
   anyway). Other checkpoints get the cheap check: each shard's size against its header.
2. The model is built with a LinearFactory (one method object per Linear, chosen from
   quantization_config, or AutoAWQ / AutoGPTQ side files: formats/quantization_config.py) and the
   rest of the caller's `Backends` (attention and MoE backends, module classes; under tensor
   parallelism the ranks' all-reduce and logits gather). AWQ / GPTQ tensors are checked against
   the config (bits, group size, in/out features, g_idx) before they are used (formats/int4_check.py).
3. Layer by layer: float tensors of plain modules load through models.loader (cast to the model
   dtype, dequantized when a dense module meets a quantized tensor); a QuantLinear's own tensors
   are copied as stored (int32 codes, fp8, fp32 / fp16 scales); then each method repacks its
   weights for the kernels (CUDA) or caches a dequantized copy (CPU).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from dsquant.config import load_config
from dsquant.errors import CheckpointError
from dsquant.formats.int4_check import check_g_idx, check_int4_shapes
from dsquant.models.causal_lm import CausalLM
from dsquant.models.checkpoint import INDEX_NAME, SINGLE_NAME, CheckpointReader, check_shard_size, sha256_file
from dsquant.models.layers import Backends
from dsquant.models.loader import FLOAT_DTYPES, WeightSource, check_unexpected, default_dtype, load_tensors
from dsquant.runtime.layers.linear import LinearFactory, QuantLinear

MANIFEST = "dsquant.json"
MADE_BY_KEY = "dsquant"  # config.json key dsquant quantize writes: {"version", "manifest"}


def _made_by_dsquant(root: Path) -> bool:
    try:
        return MADE_BY_KEY in json.loads((root / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False  # load_config reports a missing or broken config.json


def _shard_files(root: Path) -> list[Path]:
    try:
        index = json.loads((root / INDEX_NAME).read_text())["weight_map"]
        return [root / f for f in sorted(set(index.values())) if (root / f).is_file()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [root / SINGLE_NAME] if (root / SINGLE_NAME).is_file() else []  # CheckpointReader reports the rest


def verify_manifest(model_dir: str | Path) -> int:
    """Check the shards listed in dsquant.json against their sha256; return how many were checked.

    Without dsquant.json: refuse a dsquant-made artifact, else check each shard's size against
    its safetensors header (and return 0)."""
    root = Path(model_dir)
    path = root / MANIFEST
    if not path.is_file():
        if _made_by_dsquant(root):
            raise CheckpointError(f"{path}: missing, but config.json says dsquant made this artifact; without "
                                  "the manifest its shards cannot be checked (pass --no-verify to serve it anyway)")
        for shard in _shard_files(root):
            check_shard_size(shard)
        return 0
    try:
        shards = json.loads(path.read_text()).get("shards") or {}
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a valid JSON manifest ({e})") from None
    for name, expected in sorted(shards.items()):
        shard = root / name
        if not shard.is_file():
            raise CheckpointError(f"{shard}: shard listed in {MANIFEST} is missing")
        found = sha256_file(shard)
        if found != str(expected).lower():
            raise CheckpointError(f"{shard}: sha256 {found[:16]}... disagrees with {MANIFEST} "
                                  f"({str(expected)[:16]}...); the shard is corrupt or was changed")
    return len(shards)


def _check_int4(module: QuantLinear, prefix: str, tensors: dict, reader) -> None:
    """AWQ / GPTQ tensors against the config (formats/int4_check.py): named error, never a wrong decode."""
    method = module.method
    shapes = {a: tuple(t.shape) for a, t in tensors.items()}
    file_of = lambda key: str(reader.file_of(key)) if key in reader else str(reader.root)  # noqa: E731
    check_int4_shapes(method.name, method.group_size, module.out_features, module.in_features, shapes,
                      prefix, file_of, method.source)
    if "g_idx" in tensors:
        key = f"{prefix}.g_idx"
        check_g_idx(tensors["g_idx"], module.in_features, method.group_size, key, file_of(key))


def _load_quant_params(module: QuantLinear, prefix: str, source: WeightSource, device, dtype) -> None:
    reader = source.reader
    metas = dict(module.named_parameters(recurse=False))
    tensors = {}
    for attr, meta in metas.items():
        key = f"{prefix}.{attr}"
        if key not in reader:
            raise CheckpointError(f"{reader.root}: tensor {key!r} is missing; {module.method.name} "
                                  f"weights need it (shape {tuple(meta.shape)})")
        tensors[attr] = source._take(key)
    if module.method.name in ("awq", "gptq"):
        _check_int4(module, prefix, {a: t for a, t in tensors.items() if a != "bias"}, reader)
    for attr, meta in metas.items():
        key, src = f"{prefix}.{attr}", tensors[attr]
        if attr != "weight_shape" and tuple(src.shape) != tuple(meta.shape):
            raise CheckpointError(f"{reader.file_of(key)}: tensor {key!r} has shape {tuple(src.shape)}, "
                                  f"expected {tuple(meta.shape)} for {module.method.name}")
        floaty = meta.dtype in FLOAT_DTYPES
        if floaty and src.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{reader.file_of(key)}: tensor {key!r} has dtype {src.dtype}, "
                                  "expected a float dtype")
        if not floaty and src.dtype.is_floating_point != meta.dtype.is_floating_point:
            raise CheckpointError(f"{reader.file_of(key)}: tensor {key!r} has dtype {src.dtype}, "
                                  f"expected {meta.dtype}")
        if attr == "bias":
            src = src.to(dtype)
        elif src.dtype == torch.int64 and meta.dtype == torch.int32:
            src = src.to(torch.int32)
        module._parameters[attr] = torch.nn.Parameter(src.to(device), requires_grad=False)


def load_layer_quantized(model: CausalLM, source: WeightSource, layer: int | None, device, dtype,
                         prepare=None) -> None:
    """Materialise one decoder layer (None: embeddings, norm, lm_head) and process its linears."""
    if layer is None:  # embeddings, final norm, lm_head
        modules = [(n, m) for n, m in model.named_modules() if not n.startswith("model.layers")]
    else:
        modules = list(model.model.layers[layer].named_modules(prefix=f"model.layers.{layer}"))
    linears = [(n, m) for n, m in modules if isinstance(m, QuantLinear)]
    quant: dict[str, QuantLinear] = {}
    for name, mod in linears:
        mod.compute_dtype = dtype
        if mod.method.name != "dense":
            quant[name] = mod
    names = [f"{prefix}.{p}" if prefix else p for prefix, m in modules
             for p, t in list(m._parameters.items()) + list(m._buffers.items()) if t is not None]
    plain = [n for n in names if n.rpartition(".")[0] not in quant]
    load_tensors(model, source, plain, device, dtype)
    for prefix, mod in quant.items():
        _load_quant_params(mod, prefix, source, device, dtype)
    if prepare is not None and layer is not None:
        prepare(model.model.layers[layer])  # e.g. stack MoE experts before per-linear repacking
    for _, mod in linears:
        if next(mod.parameters(recurse=False), None) is not None:  # not taken by `prepare`
            mod.method.process_weights_after_loading(mod)


def load_runtime_model(path: str | Path, backends: Backends, dtype: torch.dtype | None = None,
                       device: str | torch.device = "cpu", verify: bool = True,
                       prepare_layer=None, kernels: bool = True, reader=None, parallel=None) -> CausalLM:
    """The whole model on `device`, every Linear a QuantLinear of its checkpoint's format.

    kernels=False keeps every linear on its pure-torch path (dequantized weight), on CUDA too.
    `reader` replaces the CheckpointReader of `path` (benchmarks pass random weights made on demand).
    `parallel` (a runtime.parallel.state.ParallelState): at world size > 1 only this rank's shard
    is built and read (runtime/parallel/model.py)."""
    if verify:
        verify_manifest(path)
    cfg = load_config(path)
    reader = reader if reader is not None else CheckpointReader(path)
    factory = LinearFactory(cfg.quantization_config, reader, kernels=kernels, source=cfg.quantization_source)
    backends = dataclasses.replace(backends, linear=factory)
    sharded = parallel is not None and parallel.world_size > 1
    if sharded:  # the model is built as this rank's shard, read through the plan's reader
        from dsquant.runtime.parallel.model import tensor_parallel_backends

        backends, plan = tensor_parallel_backends(backends, cfg, reader, parallel)
    model = CausalLM(cfg, backends)
    if sharded:
        reader = plan.reader()
    source = WeightSource(reader, cfg)
    dtype = dtype or default_dtype(cfg)
    with torch.no_grad():
        load_layer_quantized(model, source, None, device, dtype)
        for i in range(cfg.num_hidden_layers):
            load_layer_quantized(model, source, i, device, dtype, prepare_layer)
    check_unexpected(model, source)
    model.linear_methods = dict(factory.method_counts)
    return model.eval()
