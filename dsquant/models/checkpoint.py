"""Lazy, read-only access to a checkpoint directory's safetensors shards.

Accepts `model.safetensors`, or shards listed by `model.safetensors.index.json`. Tensors are read
one at a time (memory-mapped by safetensors), so a single decoder layer can be materialised
without touching the rest of the model. Pickle-based weights (`*.bin`, `*.pt`) are refused:
dsquant never unpickles.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dsquant.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def sha256_file(path: str | Path, chunk: int = 1 << 24) -> str:
    """Hex sha256 of a file, read in chunks (shard checksums in dsquant.json)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_shard_size(path: str | Path) -> None:
    """Check a safetensors file's size against its header: 8 bytes of header length, the JSON
    header, then exactly the bytes its tensors' data_offsets end at. Catches truncated or padded
    shards without reading the data (a cheap check where no checksums are known)."""
    path = Path(path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
            if not 0 < n <= size - 8:
                raise ValueError(f"header length {n} does not fit the file's {size} bytes")
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from None
    if size != 8 + n + end:
        raise CheckpointError(f"{path}: the header says {8 + n + end} bytes but the file has {size}; "
                              "the shard is truncated or corrupt")


def layer_of(key: str) -> int | None:
    """Decoder-layer index of a tensor name, or None for embeddings, final norm, lm_head."""
    m = _LAYER_RE.match(key)
    return int(m.group(1)) if m else None


class CheckpointReader:
    """Maps tensor names to shard files and reads tensors on demand."""

    def __init__(self, model_dir: str | Path):
        self.root = Path(model_dir)
        self.key_to_file: dict[str, str] = {}
        self._handles: dict[str, object] = {}
        index = self.root / INDEX_NAME
        if index.is_file():
            self._read_index(index)
        elif (self.root / SINGLE_NAME).is_file():
            for key in self._open(SINGLE_NAME).keys():
                self.key_to_file[key] = SINGLE_NAME
        else:
            pickled = sorted(p.name for p in self.root.glob("*.bin")) + sorted(p.name for p in self.root.glob("*.pt"))
            if pickled:
                raise CheckpointError(f"{self.root}: only pickle weights found ({pickled[0]}); dsquant "
                                      "never unpickles: convert them to safetensors first")
            raise CheckpointError(f"{self.root}: no weights found; expected {SINGLE_NAME} or "
                                  f"{INDEX_NAME} with its shards")
        self._layer_keys: dict[int | None, list[str]] = {}
        for key in self.key_to_file:
            self._layer_keys.setdefault(layer_of(key), []).append(key)

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: expected JSON with a 'weight_map' object ({e})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: 'weight_map' is empty or not an object")
        for shard in sorted(set(weight_map.values())):
            if not (self.root / shard).is_file():
                raise CheckpointError(f"{self.root / shard}: shard listed in {INDEX_NAME} is missing")
        for shard in sorted(set(weight_map.values())):
            present = set(self._open(shard).keys())
            for key in (k for k, f in weight_map.items() if f == shard):
                if key not in present:
                    raise CheckpointError(f"{self.root / shard}: tensor {key!r} listed in "
                                          f"{INDEX_NAME} is not in the shard")
        self.key_to_file = dict(weight_map)

    def _open(self, shard: str):
        if shard not in self._handles:
            path = self.root / shard
            try:
                self._handles[shard] = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({e})") from None
        return self._handles[shard]

    def keys(self) -> list[str]:
        return list(self.key_to_file)

    def layer_keys(self, layer: int | None) -> list[str]:
        """Tensor names of decoder layer `layer` (None: the non-layer tensors)."""
        return list(self._layer_keys.get(layer, []))

    def __contains__(self, key: str) -> bool:
        return key in self.key_to_file

    def file_of(self, key: str) -> Path:
        return self.root / self.key_to_file[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._open(self.key_to_file[key]).get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        if key not in self.key_to_file:
            raise CheckpointError(f"{self.root}: tensor {key!r} is missing from the checkpoint")
        shard = self.key_to_file[key]
        try:
            return self._open(shard).get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{self.root / shard}: cannot read tensor {key!r} ({e})") from None

    def total_bytes(self) -> int:
        return sum((self.root / f).stat().st_size for f in set(self.key_to_file.values()))
