"""What the formats' configs share: the file a config came from, integer field checks, the
modules a config keeps dense (`modules_to_not_convert`), and the one-line INT4 description.

Conventions of every formats/ module: a Linear has out_features N and in_features K; a dense
weight is [N, K] as in torch; "q" tensors hold unsigned integer codes in an int32/uint8 tensor;
group size G (-1 or 0: one group spanning K).
"""
from __future__ import annotations

from dsquant.errors import ConfigError

CONFIG_JSON = "config.json"


def as_int(value, field: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{source}: {field} must be an integer, found {value!r}")
    return value


def int4_bits_and_group(q: dict, method: str, source: str) -> int:
    """The group size of an awq / gptq config (any spelling of its keys), after checking bits is 4."""
    bits = as_int(q.get("bits", q.get("w_bit", 4)), "bits", source)
    if bits != 4:
        raise ConfigError(f"{source}: {method} bits {bits} is not supported (expected 4)")
    group = as_int(q.get("group_size", q.get("q_group_size", 128)), "group_size", source)
    if group == 0 or group < -1:
        raise ConfigError(f"{source}: {method} group_size {group} is not valid (expected a positive size or -1)")
    return group


def names(q: dict, key: str) -> tuple[str, ...] | None:
    """A config's list of module names as a tuple: None when the key is absent, () when null or empty."""
    return tuple(q[key] or ()) if key in q else None


def names_entries(modules_to_not_convert: tuple[str, ...] | None, ignored_layers: tuple[str, ...] | None) -> dict:
    """The name lists as a config writes them: a list, null when empty, left out when None."""
    out = {}
    if modules_to_not_convert is not None:
        out["modules_to_not_convert"] = list(modules_to_not_convert) or None
    if ignored_layers is not None:
        out["ignored_layers"] = list(ignored_layers) or None
    return out


def not_converted(prefix: str, *lists: tuple[str, ...] | None) -> bool:
    """True when a module-name substring in `lists` (modules_to_not_convert, vLLM's ignored_layers)
    is in `prefix`: vLLM, SGLang and transformers match these lists by substring."""
    return any(s and (s in prefix) for skip in lists for s in (skip or ()))


def describe_int4(method: str, bits: int, group_size: int, zero_point: bool, version: str, desc_act: bool,
                  source: str) -> str:
    """One line for `dsquant inspect`."""
    zp = "asymmetric (zero point)" if zero_point else "symmetric"
    group = "per channel" if group_size <= 0 else f"group {group_size}"
    version = {"gemm": "AutoAWQ gemm", "gptq": "GPTQ v1", "gptq_v2": "GPTQ v2"}.get(version, version)
    extra = ", act-order (desc_act)" if desc_act else ""
    return f"{method} {bits}-bit, {group}, {zp}, {version}{extra} (from {source})"
