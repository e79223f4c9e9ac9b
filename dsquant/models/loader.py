"""Build a model from a checkpoint directory and fill it tensor by tensor, optionally per layer.

`load_model(path)` gives the reference model (dense linears). Quantized tensors found where the
model has a dense weight are dequantized as they load: DeepSeek-V3 native FP8 (`weight` e4m3 +
`weight_scale_inv`), AWQ "gemm" and GPTQ v1 / v2, checked against the config first
(formats/int4_check.py), and compressed-tensors pack-quantized. Linears made by a runtime factory
carry the checkpoint's own tensor names, and their tensors are copied as they are.
Never executes code from a checkpoint and never unpickles.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dsquant.config import ModelConfig, load_config
from dsquant.errors import CheckpointError
from dsquant.formats import AwqConfig, GptqConfig, parse_quantization_config
from dsquant.formats.awq_gemm import dequantize_awq
from dsquant.formats.compressed_tensors import dequantize_pack_quantized
from dsquant.formats.fp8_block import dequantize_fp8_block
from dsquant.formats.gptq import dequantize_gptq
from dsquant.formats.int4_check import INT4_TENSORS, check_g_idx, check_int4_shapes
from dsquant.formats.int_grid import group_index
from dsquant.models.causal_lm import CausalLM
from dsquant.models.checkpoint import CheckpointReader, layer_of
from dsquant.models.layers import Backends

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_FP32_PARAMS = ("e_score_correction_bias",)  # kept in fp32, as transformers does


def default_dtype(cfg: ModelConfig) -> torch.dtype:
    """The checkpoint's own float dtype when it is bf16/fp16/fp32, else bf16 (DeepSeek's)."""
    return _DTYPE_NAMES.get(str(cfg.torch_dtype), torch.bfloat16)


class WeightSource:
    """Resolves a model parameter name to a tensor from the checkpoint, dequantizing if needed."""

    def __init__(self, reader: CheckpointReader, cfg: ModelConfig):
        self.reader, self.cfg = reader, cfg
        self.format = parse_quantization_config(cfg.quantization_config, cfg.quantization_source or "config.json")
        self.quant_method = self.format.method if self.format is not None else None
        # INT4 config (validated: bits, group size, format version); absent: AWQ g128 / GPTQ v1
        self.int4 = self.format if isinstance(self.format, (AwqConfig, GptqConfig)) else None
        self.group_size = self.int4.group_size if self.int4 else 128
        self.consumed: set[str] = set()

    def _take(self, key: str) -> torch.Tensor:
        self.consumed.add(key)
        return self.reader.get(key)

    def dense_weight(self, key: str, dtype: torch.dtype, shape: tuple | None = None) -> torch.Tensor | None:
        """The float [N, K] weight for `key` (`<module>.weight`), or None if nothing provides it.

        `shape` (N, K), when given, is what AWQ / GPTQ tensors are checked against before decoding."""
        reader, prefix = self.reader, key[: -len(".weight")]
        if key in reader:
            t = self._take(key)
            if t.dtype in FP8_DTYPES:
                scale_key = f"{prefix}.weight_scale_inv"
                if scale_key not in reader and f"{prefix}.weight_scale" in reader:
                    scale_key = f"{prefix}.weight_scale"  # compressed-tensors float-quantized
                if scale_key not in reader:
                    raise CheckpointError(f"{reader.file_of(key)}: tensor {key!r} is {t.dtype} but "
                                          f"{scale_key!r} is missing (FP8 block weights need it)")
                try:
                    return dequantize_fp8_block(t, self._take(scale_key), dtype)
                except ValueError as e:
                    raise CheckpointError(f"{reader.file_of(scale_key)}: tensor {scale_key!r}: {e}") from None
            return t
        if f"{prefix}.weight_packed" in reader:
            return self._pack_quantized(prefix, dtype)
        if f"{prefix}.qweight" in reader:
            return self._int4(prefix, dtype, shape)
        return None


    def _int4(self, prefix: str, dtype: torch.dtype, shape: tuple | None) -> torch.Tensor:
        """AWQ gemm / GPTQ (v1, v2) tensors -> dense [N, K], after checking them against the config."""
        reader = self.reader
        gptq = self.quant_method == "gptq" or (self.quant_method is None and f"{prefix}.g_idx" in reader)
        fmt = "gptq" if gptq else "awq"
        names = INT4_TENSORS[fmt]
        t = {n: self._take(f"{prefix}.{n}") for n in names if f"{prefix}.{n}" in reader}
        if "qweight" not in t or "qzeros" not in t or "scales" not in t:
            missing = next(n for n in names if n not in t)
            raise CheckpointError(f"{reader.file_of(prefix + '.qweight')}: tensor {prefix + '.' + missing!r} is "
                                  f"missing; {fmt} weights need it")
        qw = t["qweight"]
        n, k = shape if shape is not None else \
            ((qw.shape[1], qw.shape[0] * 8) if gptq else (qw.shape[1] * 8, qw.shape[0]))
        file_of = lambda key: str(reader.file_of(key)) if key in reader else str(reader.root)  # noqa: E731
        source = self.int4.source if self.int4 else ("defaults: config.json has no quantization_config and "
                                                     "there is no quant_config.json or quantize_config.json")
        check_int4_shapes(fmt, self.group_size, n, k, {a: tuple(v.shape) for a, v in t.items()}, prefix,
                          file_of, source)
        group = k if self.group_size <= 0 else self.group_size
        if gptq:
            g_idx = t.get("g_idx")
            if g_idx is None:
                g_idx = group_index(k, group)
            else:
                check_g_idx(g_idx, k, group, f"{prefix}.g_idx", file_of(f"{prefix}.g_idx"))
            return dequantize_gptq(qw, t["qzeros"], t["scales"], g_idx, dtype, v2=bool(self.int4 and self.int4.v2))
        return dequantize_awq(qw, t["qzeros"], t["scales"], group, dtype)

    def _pack_quantized(self, prefix: str, dtype: torch.dtype) -> torch.Tensor:
        """compressed-tensors pack-quantized INT4 (group strategy) -> dense [N, K]."""
        packed = self._take(f"{prefix}.weight_packed")
        scale = self._take(f"{prefix}.weight_scale")  # [N, K/G]
        n, k = packed.shape[0], packed.shape[1] * 8
        if f"{prefix}.weight_shape" in self.reader:
            n, k = (int(v) for v in self._take(f"{prefix}.weight_shape"))
        zp_key = f"{prefix}.weight_zero_point"
        zero_point = self._take(zp_key) if zp_key in self.reader else None
        return dequantize_pack_quantized(packed, scale, zero_point, (n, k), dtype)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if attr in mod._parameters:
        mod._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[attr] = value


def _check(name: str, src: torch.Tensor, expected: torch.Tensor, reader: CheckpointReader) -> None:
    where = reader.file_of(name) if name in reader else reader.root
    if tuple(src.shape) != tuple(expected.shape):
        raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(src.shape)}, expected "
                              f"{tuple(expected.shape)} from config.json")
    if expected.dtype in FLOAT_DTYPES:
        if src.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{where}: tensor {name!r} has dtype {src.dtype}, expected a float "
                                  "dtype (bfloat16, float16 or float32)")
    elif src.dtype != expected.dtype:
        raise CheckpointError(f"{where}: tensor {name!r} has dtype {src.dtype}, expected {expected.dtype}")


def load_tensors(model: CausalLM, source: WeightSource, names: list[str], device, dtype) -> None:
    """Materialise the named parameters/buffers of `model` from the checkpoint on `device`."""
    reader, cfg = source.reader, model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers(remove_duplicate=False)))
    for name in names:
        meta = params[name]
        target = torch.float32 if name.endswith(_FP32_PARAMS) else dtype
        src = None
        if meta.dtype in FLOAT_DTYPES and name.endswith(".weight"):
            src = source.dense_weight(name, target, tuple(meta.shape) if meta.ndim == 2 else None)
        elif name in reader:
            src = source._take(name)
        if src is None and name == "lm_head.weight" and cfg.tie_word_embeddings:
            src = source.dense_weight("model.embed_tokens.weight", target)
        if src is None:
            raise CheckpointError(f"{reader.root}: tensor {name!r} is missing from the checkpoint")
        _check(name, src, meta, reader)
        if meta.dtype in FLOAT_DTYPES:
            src = src.to(target)
        _set_tensor(model, name, src.to(device))


def _names_of(model: nn.Module, layer: int | None) -> list[str]:
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    return [n for n in names if layer_of(n) == layer]


def load_layer(model: CausalLM, source: WeightSource, layer: int | None, device, dtype) -> None:
    """Materialise one decoder layer (None: embeddings, final norm, lm_head)."""
    load_tensors(model, source, _names_of(model, layer), device, dtype)


def release_layer(model: CausalLM, layer: int) -> None:
    """Send a decoder layer's tensors back to the meta device (frees host/device memory)."""
    model.model.layers[layer].to("meta")


def check_unexpected(model: CausalLM, source: WeightSource) -> None:
    """Every checkpoint tensor must have been used, except MTP layers and rotary buffers."""
    n_layers = model.config.num_hidden_layers
    left = [k for k in source.reader.keys() if k not in source.consumed
            and not k.endswith("rotary_emb.inv_freq")
            and not (layer_of(k) is not None and layer_of(k) >= n_layers)]
    if left:
        raise CheckpointError(f"{source.reader.file_of(left[0])}: tensor {left[0]!r} is not used by "
                              f"{model.config.architecture} ({len(left)} unexpected tensors)")


_QUANTIZED_WEIGHT_PARTS = ("weight_packed", "qweight")  # a dense weight's quantized forms (shape checked on load)


def check_layer_headers(model: CausalLM, source: WeightSource) -> None:
    """Check every decoder layer against config.json from the safetensors headers alone, before
    any layer is loaded: each tensor the model needs is there with its shape, and no layer lies
    beyond num_hidden_layers but the num_nextn_predict_layers MTP layers (told apart by their
    `eh_proj` tensor: a plain decoder layer there means num_hidden_layers is too small)."""
    reader, cfg = source.reader, model.config
    n = cfg.num_hidden_layers
    present = sorted({layer_of(k) for k in reader.keys()} - {None})
    have = f"the checkpoint has layers {present[0]}..{present[-1]}" if present else "the checkpoint has no layers"
    extra = int(cfg.raw.get("num_nextn_predict_layers") or 0)
    beyond = [i for i in present if i >= n + extra
              or (i >= n and not any(".eh_proj." in k for k in reader.layer_keys(i)))]
    if beyond:
        key = reader.layer_keys(beyond[0])[0]
        raise CheckpointError(f"{reader.file_of(key)}: tensor {key!r} is in layer {beyond[0]}, but config.json "
                              f"says num_hidden_layers {n} ({have})")
    metas = dict(model.named_parameters(remove_duplicate=False))
    metas.update(dict(model.named_buffers(remove_duplicate=False)))
    for i in range(n):
        for name in _names_of(model, i):
            expected = tuple(metas[name].shape)
            if name in reader:
                shape = reader.shape(name)
                if shape != expected:
                    raise CheckpointError(f"{reader.file_of(name)}: tensor {name!r} has shape {shape}, expected "
                                          f"{expected} from config.json")
            elif not (name.endswith(".weight")
                      and any(f"{name[:-len('weight')]}{p}" in reader for p in _QUANTIZED_WEIGHT_PARTS)):
                raise CheckpointError(f"{reader.root}: tensor {name!r} is missing, but config.json says "
                                      f"num_hidden_layers {n} ({have})")


def open_model(path: str | Path, backends: Backends | None = None) -> tuple[CausalLM, WeightSource]:
    """Config + meta-device model + weight source, for layer-by-layer streaming."""
    cfg = load_config(path)
    reader = CheckpointReader(path)
    return CausalLM(cfg, backends), WeightSource(reader, cfg)


def load_model(path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
               backends: Backends | None = None) -> CausalLM:
    """The whole model on `device` in `dtype` (default: the checkpoint's), ready for forward."""
    model, source = open_model(path, backends)
    dtype = dtype or default_dtype(model.config)
    load_layer(model, source, None, device, dtype)
    for i in range(model.config.num_hidden_layers):
        load_layer(model, source, i, device, dtype)
    check_unexpected(model, source)
    return model.eval()
