"""The one quantization_config parser: a checkpoint's config, as any tool writes it, read into its
format's frozen dataclass (awq_gemm.AwqConfig, gptq.GptqConfig, fp8_block.Fp8BlockConfig,
compressed_tensors.CompressedTensorsConfig) by `parse_quantization_config`.

Where a checkpoint says how it is quantized, in order of precedence:
  config.json `quantization_config`   (transformers / vLLM / dsquant; wins when present)
  quant_config.json                   AutoAWQ: {zero_point, q_group_size, w_bit, version: "GEMM"}
  quantize_config.json                AutoGPTQ / GPTQModel: {bits, group_size, desc_act, sym,
                                      checkpoint_format: "gptq" | "gptq_v2", ...}
Every file present must agree with the one that wins (method, bits, group size, zero point / sym,
act-order, format version), or loading is refused naming both files: a checkpoint that says two
things is never guessed at. A side file's content is turned into a quantization_config dict
(`normalize`), so everything downstream reads one shape of config.

Layouts live in the format modules; this one holds no tensors.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Union

from dsquant.errors import ConfigError
from dsquant.formats.awq_gemm import AwqConfig
from dsquant.formats.base import CONFIG_JSON
from dsquant.formats.compressed_tensors import CompressedTensorsConfig
from dsquant.formats.fp8_block import Fp8BlockConfig
from dsquant.formats.gptq import GptqConfig


def read_json_object(path: Path) -> dict:
    """The JSON object in `path`; a ConfigError naming the file if it is not valid JSON or not an object."""
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw


AUTOAWQ_FILE = "quant_config.json"
AUTOGPTQ_FILE = "quantize_config.json"
SIDE_FILES = (AUTOAWQ_FILE, AUTOGPTQ_FILE)

QuantFormat = Union[AwqConfig, GptqConfig, Fp8BlockConfig, CompressedTensorsConfig]
_FORMATS = {"awq": AwqConfig, "gptq": GptqConfig, "fp8": Fp8BlockConfig,
            "compressed-tensors": CompressedTensorsConfig}


def parse_quantization_config(q: dict | None, source: str = CONFIG_JSON) -> QuantFormat | None:
    """A quantization_config dict (config.json's, or a side file's after `normalize`) -> its format's
    dataclass, validated; None for a dense checkpoint. Every reader (runtime, reference loader,
    inspect) calls this, so every reader accepts and refuses the same configs."""
    q = q or {}
    method = q.get("quant_method")
    if method is None:
        return None
    if not isinstance(method, str) or method not in _FORMATS:
        raise ConfigError(f"{source}: quantization_config.quant_method {method!r} is not "
                          "supported (expected awq, gptq, fp8 or compressed-tensors)")
    return _FORMATS[method].from_dict(q, source)


def normalize(raw: dict, source: str) -> dict:
    """A side file's JSON (AutoAWQ quant_config.json, AutoGPTQ quantize_config.json) -> a
    quantization_config dict in config.json's spelling."""
    method = str(raw.get("quant_method") or "").lower()
    if not method:  # AutoAWQ and AutoGPTQ leave it out: the file name tells
        method = "awq" if Path(source).name == AUTOAWQ_FILE else "gptq"
    out = {"quant_method": method}
    if method == "awq":
        out.update(bits=raw.get("w_bit", raw.get("bits", 4)),
                   group_size=raw.get("q_group_size", raw.get("group_size", 128)),
                   zero_point=raw.get("zero_point", True), version=str(raw.get("version", "gemm")).lower())
    elif method == "gptq":
        out.update(bits=raw.get("bits", 4), group_size=raw.get("group_size", 128),
                   desc_act=raw.get("desc_act", False), sym=raw.get("sym", True),
                   checkpoint_format=raw.get("checkpoint_format") or "gptq")
        if raw.get("is_marlin_format"):
            out["is_marlin_format"] = True
    else:
        return dict(raw)
    if raw.get("modules_to_not_convert"):
        out["modules_to_not_convert"] = raw["modules_to_not_convert"]
    return out


def _key(q: dict, source: str) -> tuple:
    """What two configs must agree on."""
    method = str(q.get("quant_method", "")).lower()
    if method in ("awq", "gptq"):
        s = _FORMATS[method].from_dict(q, source)
        return s.method, s.bits, s.group_size, s.zero_point, s.desc_act, s.version
    return (method,)


def resolve(model_dir: str | Path, config_json: dict) -> tuple[dict | None, str | None]:
    """The checkpoint's quantization_config and the file it came from (None, None: dense).

    config.json's wins; side files must agree with it (or with each other)."""
    root = Path(model_dir)
    found: list[tuple[dict, str]] = []
    if isinstance(config_json.get("quantization_config"), dict):
        found.append((config_json["quantization_config"], CONFIG_JSON))
    for name in SIDE_FILES:
        if (root / name).is_file():
            found.append((normalize(read_json_object(root / name), name), name))
    if not found:
        return None, None
    winner, source = found[0]
    for other, other_source in found[1:]:
        if _key(winner, source) != _key(other, other_source):
            raise ConfigError(f"{root / source} and {root / other_source} disagree on the quantization: "
                              f"{_key(winner, source)} vs {_key(other, other_source)} (method, bits, group_size, "
                              "zero point, desc_act, format); remove or fix one of them")
    return winner, source
