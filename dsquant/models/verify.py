"""Check a checkpoint's tensor names, shapes and dtypes against its config, from headers only.

`dsquant inspect` runs this, so a wrong shape, a wrong dtype or a missing tensor is reported
before any weight is read. For each tensor the reference model expects, the checkpoint must
hold it dense, or in a quantized form whose shapes agree (FP8 block, AWQ gemm, GPTQ v1 / v2
against the parsed group size and in/out features (formats/int4_check.py), compressed-tensors
pack-quantized).
"""
from __future__ import annotations

from dsquant.errors import CheckpointError
from dsquant.formats import AwqConfig, GptqConfig, parse_quantization_config
from dsquant.formats.fp8_block import fp8_block_shape
from dsquant.formats.int4_check import INT4_TENSORS, check_int4_shapes
from dsquant.models.causal_lm import CausalLM
from dsquant.models.checkpoint import CheckpointReader

FLOAT = ("BF16", "F16", "F32")
FP8 = ("F8_E4M3", "F8_E5M2")


def _meta(reader: CheckpointReader, key: str) -> tuple[tuple[int, ...], str]:
    sl = reader._open(reader.key_to_file[key]).get_slice(key)
    return tuple(sl.get_shape()), sl.get_dtype()


def _fail(reader: CheckpointReader, key: str, what: str) -> CheckpointError:
    return CheckpointError(f"{reader.file_of(key)}: tensor {key!r} {what}")


def _expect(reader, key, shape, dtypes) -> None:
    found_shape, found_dtype = _meta(reader, key)
    if found_shape != tuple(shape):
        raise _fail(reader, key, f"has shape {found_shape}, expected {tuple(shape)} from config.json")
    if found_dtype not in dtypes:
        raise _fail(reader, key, f"has dtype {found_dtype}, expected one of {', '.join(dtypes)}")


def _check_linear(reader: CheckpointReader, prefix: str, n: int, k: int,
                  spec: AwqConfig | GptqConfig | None) -> bool:
    """True if the module's weight is present in some known form (raises if malformed)."""
    w = f"{prefix}.weight"
    if w in reader:
        _, dtype = _meta(reader, w)
        if dtype in FP8:
            _expect(reader, w, (n, k), FP8)
            if f"{prefix}.weight_scale_inv" in reader:
                _expect(reader, f"{prefix}.weight_scale_inv", fp8_block_shape(n, k), ("F32", "BF16"))
            return True
        _expect(reader, w, (n, k), FLOAT)
        return True
    if f"{prefix}.qweight" in reader:
        gptq = spec.method == "gptq" if spec else f"{prefix}.g_idx" in reader
        fmt = "gptq" if gptq else "awq"
        shapes = {a: _meta(reader, f"{prefix}.{a}")[0] for a in INT4_TENSORS[fmt] if f"{prefix}.{a}" in reader}
        file_of = lambda key: str(reader.file_of(key)) if key in reader else str(reader.root)  # noqa: E731
        check_int4_shapes(fmt, spec.group_size if spec else 128, n, k, shapes, prefix, file_of,
                          spec.source if spec else "defaults (no quantization config)")
        for a in ("qweight", "qzeros"):
            _expect(reader, f"{prefix}.{a}", shapes[a], ("I32",))
        _expect(reader, f"{prefix}.scales", shapes["scales"], FLOAT)
        if "g_idx" in shapes:
            _expect(reader, f"{prefix}.g_idx", shapes["g_idx"], ("I32", "I64"))
        return True
    if f"{prefix}.weight_packed" in reader:
        _expect(reader, f"{prefix}.weight_packed", (n, k // 8), ("I32",))
        return True
    return False


def verify_checkpoint(model: CausalLM, reader: CheckpointReader) -> int:
    """Raise CheckpointError on the first missing or malformed tensor; return tensors checked."""
    cfg = model.config
    fmt = parse_quantization_config(cfg.quantization_config, cfg.quantization_source or "config.json")
    spec = fmt if isinstance(fmt, (AwqConfig, GptqConfig)) else None
    checked = 0
    for name, p in list(model.named_parameters()):
        prefix, _, attr = name.rpartition(".")
        module = model.get_submodule(prefix)
        is_linear = attr == "weight" and p.ndim == 2 and hasattr(module, "in_features")
        if is_linear and _check_linear(reader, prefix, p.shape[0], p.shape[1], spec):
            checked += 1
            continue
        if name not in reader:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            raise CheckpointError(f"{reader.root}: tensor {name!r} is missing; config.json "
                                  f"({cfg.architecture}) expects shape {tuple(p.shape)}")
        _expect(reader, name, p.shape, FLOAT)
        checked += 1
    return checked
