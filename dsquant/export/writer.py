"""Artifact directory writing: nothing is lost, an interrupted run resumes.

Everything goes to `OUT.partial/` first: one safetensors shard per decoder layer
(model-{i+1:05d}-of-{L+1:05d}.safetensors), written to a temporary name, given a plain file's
mode (0644 under the usual umask, as config.json; safetensors itself writes 0600) and renamed, then a
resume state (next layer, its input hidden states, per-layer stats). The last shard holds
embeddings, final norm and lm_head. `finalize` writes config.json, the index, dsquant.json and
the tokenizer files, then renames `OUT.partial` to `OUT`. An existing OUT is replaced only
with force=True; a partial run with other arguments is refused rather than mixed.

Disk: before each write the free space must hold what the write and the ones right after it
need (a shard plus the resume hidden states, which are ~1 GB for a real model); a failed write
(OSError or SafetensorError) is one DsquantError naming the file and the bytes, the temporary
file is removed and OUT.partial stays resumable. A run that fails before saving any progress
leaves no OUT.partial behind (`discard_if_empty`).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dsquant.errors import DsquantError
from dsquant.models.checkpoint import sha256_file

STATE = "resume.json"
HIDDEN = "resume_hidden.safetensors"
MARGIN = 1 << 20  # resume.json, the index and filesystem overhead
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json",
                   "chat_template.jinja")


def _umask() -> int:
    """The process umask, read without changing it where /proc tells it (Linux), else set back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _file_mode(path: Path) -> None:
    """Give `path` the mode a plain new file gets (0666 less the umask, 0644 by default), as
    config.json has: safetensors writes its files 0600, unreadable to another serving user."""
    os.chmod(path, 0o666 & ~_umask())


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class ArtifactWriter:
    def __init__(self, out_dir: str | Path, num_layers: int, run_key: dict, force: bool,
                 max_shard_bytes: int | None = None):
        """max_shard_bytes: a layer's tensors over this size go to several files (never a tensor split)."""
        self.final = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self.partial = self.final.with_name(self.final.name + ".partial")
        self.total = num_layers + 1
        self.run_key = run_key
        self.state: dict = {"run_key": run_key, "next_layer": 0, "layers": {}}
        if self.final.exists() and not force:
            raise DsquantError(f"{self.final}: already exists; pass --force to replace it")
        if self.partial.exists():
            state_path = self.partial / STATE
            old = json.loads(state_path.read_text()) if state_path.exists() else None
            if force or old is None:
                shutil.rmtree(self.partial)
            elif old.get("run_key") != run_key:
                raise DsquantError(f"{self.partial}: holds an interrupted run with other arguments; "
                                   "rerun with the same arguments to resume, or pass --force to start over")
            else:
                self.state = old
        self.partial.mkdir(parents=True, exist_ok=True)
        self._check_disk(1 << 26, "a run")

    def _check_disk(self, need: int, what: str) -> None:
        free = shutil.disk_usage(self.partial).free
        if free < need:
            raise DsquantError(f"{self.partial}: {what} needs {need} bytes ({need / 2 ** 20:.1f} MiB) free, "
                               f"the disk has {free} ({free / 2 ** 20:.1f} MiB)")

    def _save(self, tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
        """save_file to path + '.tmp', then rename; a failure removes the temporary file."""
        tmp = path.with_name(path.name + ".tmp")
        nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
        try:
            save_file(tensors, str(tmp), metadata=metadata)
            _file_mode(tmp)
        except (OSError, SafetensorError) as e:
            tmp.unlink(missing_ok=True)
            raise DsquantError(f"{tmp}: cannot write {nbytes} bytes ({e}); {self.partial} is kept: "
                               "free some space and rerun the same command to resume") from None
        os.replace(tmp, path)

    def discard_if_empty(self) -> None:
        """Remove OUT.partial if no layer's progress was saved in it (nothing to resume)."""
        if self.partial.is_dir() and not (self.partial / STATE).exists():
            shutil.rmtree(self.partial, ignore_errors=True)

    @property
    def next_layer(self) -> int:
        return int(self.state["next_layer"])

    def shard_name(self, index: int) -> str:
        return f"model-{index + 1:05d}-of-{self.total:05d}.safetensors"

    def write_shard(self, index: int, tensors: dict[str, torch.Tensor], reserve: int = 0) -> str:
        """Write shard `index` (0-based; layer i is shard i, the last is non-layer tensors).

        `reserve`: bytes the writes right after this one need (the resume hidden states)."""
        name = self.shard_name(index)
        cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        shard_bytes = sum(v.numel() * v.element_size() for v in cpu.values())
        self._check_disk(shard_bytes + reserve + MARGIN, f"shard {name} ({shard_bytes} bytes) and the "
                                                         f"resume state ({reserve} bytes)")
        parts = self._split(cpu)
        for j, part in enumerate(parts):
            part_name = name if len(parts) == 1 else name.replace(".safetensors", f"-{j + 1:03d}.safetensors")
            self._save(part, self.partial / part_name, {"format": "pt"})
        return name

    def _split(self, tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Tensors in order, cut into runs of at most max_shard_bytes (a bigger tensor alone)."""
        parts: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for key, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if self.max_shard_bytes and parts[-1] and size + nbytes > self.max_shard_bytes:
                parts.append({})
                size = 0
            parts[-1][key] = t
            size += nbytes
        return parts

    def save_progress(self, next_layer: int, hidden: torch.Tensor, layer_stats: dict) -> None:
        """After layer next_layer - 1: its outputs (the next inputs) and its stats, atomically."""
        hidden = hidden.detach().contiguous().cpu()
        self._check_disk(hidden.numel() * hidden.element_size() + MARGIN, f"{HIDDEN}")
        self._save({"hidden": hidden}, self.partial / HIDDEN)
        self.state["next_layer"] = next_layer
        self.state["layers"][str(next_layer - 1)] = layer_stats
        _atomic_write_text(self.partial / STATE, json.dumps(self.state, indent=1))

    def load_hidden(self) -> torch.Tensor:
        return load_file(str(self.partial / HIDDEN))["hidden"]

    def weight_map(self) -> dict[str, str]:
        from safetensors import safe_open

        out = {}
        for i in range(self.total):
            stem = self.shard_name(i)[: -len(".safetensors")]
            for path in sorted(self.partial.glob(f"{stem}*.safetensors")):  # parts: {stem}-001.safetensors, ...
                with safe_open(str(path), "pt") as f:
                    out.update({k: path.name for k in f.keys()})
        return out

    def finalize(self, config: dict, manifest: dict, source_dir: Path) -> Path:
        """Index, config, tokenizer files and dsquant.json, then rename OUT.partial -> OUT."""
        weight_map = self.weight_map()
        total_size = sum((self.partial / n).stat().st_size for n in set(weight_map.values()))
        _atomic_write_text(self.partial / "model.safetensors.index.json", json.dumps(
            {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
        _atomic_write_text(self.partial / "config.json", json.dumps(config, indent=2))
        for f in TOKENIZER_FILES:
            if (source_dir / f).exists():
                shutil.copy2(source_dir / f, self.partial / f)
        manifest["shards"] = {n: sha256_file(self.partial / n) for n in sorted(set(weight_map.values()))}
        _atomic_write_text(self.partial / "dsquant.json", json.dumps(manifest, indent=1))
        for f in (STATE, HIDDEN):
            (self.partial / f).unlink(missing_ok=True)
        if self.final.exists():
            old = self.final.with_name(self.final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(self.final, old)
            os.replace(self.partial, self.final)
            shutil.rmtree(old)
        else:
            os.replace(self.partial, self.final)
        return self.final
