"""Quantization configs as other tools write them, read into one form (`Int4Spec` for INT4).

Where a checkpoint says how it is quantized, in order of precedence:
  config.json `quantization_config`   (transformers / vLLM / dsquant; wins when present)
  quant_config.json                   AutoAWQ: {zero_point, q_group_size, w_bit, version: "GEMM"}
  quantize_config.json                AutoGPTQ / GPTQModel: {bits, group_size, desc_act, sym,
                                      checkpoint_format: "gptq" | "gptq_v2", ...}
Every file present must agree with the one that wins (method, bits, group size, zero point / sym,
act-order, format version), or loading is refused naming both files: a checkpoint that says two
things is never guessed at. A side file's content is turned into a quantization_config dict
(`normalize`), so everything downstream reads one shape of config.

GPTQ checkpoint formats: "gptq" (v1, the default) stores each zero point as z - 1, "gptq_v2"
stores z itself. Marlin / BitBLAS / other repacked formats are refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dsquant.errors import ConfigError


def read_json_object(path: Path) -> dict:
    """The JSON object in `path`; a ConfigError naming the file if it is not valid JSON or not an object."""
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw


CONFIG_JSON = "config.json"
AUTOAWQ_FILE = "quant_config.json"
AUTOGPTQ_FILE = "quantize_config.json"
SIDE_FILES = (AUTOAWQ_FILE, AUTOGPTQ_FILE)
GPTQ_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class Int4Spec:
    """An AWQ / GPTQ INT4 config, validated; `source` is the file it came from."""

    method: str  # "awq" | "gptq"
    bits: int
    group_size: int  # -1: one group spanning K (per channel)
    zero_point: bool  # asymmetric (AWQ zero_point, GPTQ not sym)
    desc_act: bool  # GPTQ act-order
    version: str  # AWQ "gemm"; GPTQ "gptq" (v1) or "gptq_v2"
    source: str = CONFIG_JSON

    @property
    def v2(self) -> bool:
        return self.version == "gptq_v2"

    def describe(self) -> str:
        """One line for `dsquant inspect`."""
        zp = "asymmetric (zero point)" if self.zero_point else "symmetric"
        group = "per channel" if self.group_size <= 0 else f"group {self.group_size}"
        version = {"gemm": "AutoAWQ gemm", "gptq": "GPTQ v1", "gptq_v2": "GPTQ v2"}.get(self.version, self.version)
        extra = ", act-order (desc_act)" if self.desc_act else ""
        return f"{self.method} {self.bits}-bit, {group}, {zp}, {version}{extra} (from {self.source})"


def _as_int(value, field: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{source}: {field} must be an integer, found {value!r}")
    return value


def int4_spec(q: dict, source: str = CONFIG_JSON) -> Int4Spec:
    """Validate an awq / gptq quantization_config (any spelling of its keys) -> Int4Spec."""
    method = str(q.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise ConfigError(f"{source}: quant_method {q.get('quant_method')!r} is not an INT4 method (awq, gptq)")
    bits = _as_int(q.get("bits", q.get("w_bit", 4)), "bits", source)
    if bits != 4:
        raise ConfigError(f"{source}: {method} bits {bits} is not supported (expected 4)")
    group = _as_int(q.get("group_size", q.get("q_group_size", 128)), "group_size", source)
    if group == 0 or group < -1:
        raise ConfigError(f"{source}: {method} group_size {group} is not valid (expected a positive size or -1)")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError(f"{source}: AWQ version {q.get('version')!r} is not supported (expected gemm)")
        zero_point = bool(q.get("zero_point", True))
        if not zero_point:
            raise ConfigError(f"{source}: AWQ zero_point false is not supported (expected true: "
                              "AutoAWQ gemm stores qzeros)")
        return Int4Spec("awq", bits, group, True, False, "gemm", source)
    if q.get("is_marlin_format"):
        raise ConfigError(f"{source}: is_marlin_format true (Marlin-repacked GPTQ) is not supported; "
                          "expected checkpoint_format gptq or gptq_v2")
    version = str(q.get("checkpoint_format") or "gptq").lower()
    if version not in GPTQ_FORMATS:
        raise ConfigError(f"{source}: GPTQ checkpoint_format {q.get('checkpoint_format')!r} is not supported "
                          f"(expected {' or '.join(GPTQ_FORMATS)})")
    return Int4Spec("gptq", bits, group, not bool(q.get("sym", True)), bool(q.get("desc_act", False)),
                    version, source)


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
        s = int4_spec(q, source)
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
