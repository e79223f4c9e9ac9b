"""Artifact directory writing: nothing is lost, an interrupted run resumes.

Everything goes to `OUT.partial/` first: one safetensors shard per decoder layer
(model-{i+1:05d}-of-{L+1:05d}.safetensors), written to a temporary name and renamed, then a
resume state (next layer, its input hidden states, per-layer stats). The last shard holds
embeddings, final norm and lm_head. `finalize` writes config.json, the index, dsquant.json and
the tokenizer files, then renames `OUT.partial` to `OUT`. An existing OUT is replaced only
with force=True; a partial run with other arguments is refused rather than mixed.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dsquant.errors import DsquantError
from dsquant.models.checkpoint import sha256_file

STATE = "resume.json"
HIDDEN = "resume_hidden.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json",
                   "chat_template.jinja")


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class ArtifactWriter:
    def __init__(self, out_dir: str | Path, num_layers: int, run_key: dict, force: bool):
        self.final = Path(out_dir)
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
        self._check_disk()

    def _check_disk(self, need: int = 1 << 26) -> None:
        free = shutil.disk_usage(self.partial).free
        if free < need:
            raise DsquantError(f"{self.partial}: only {free >> 20} MiB free on this disk")

    @property
    def next_layer(self) -> int:
        return int(self.state["next_layer"])

    def shard_name(self, index: int) -> str:
        return f"model-{index + 1:05d}-of-{self.total:05d}.safetensors"

    def write_shard(self, index: int, tensors: dict[str, torch.Tensor]) -> str:
        """Write shard `index` (0-based; layer i is shard i, the last is non-layer tensors)."""
        name = self.shard_name(index)
        tmp = self.partial / (name + ".tmp")
        cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        self._check_disk(sum(v.numel() * v.element_size() for v in cpu.values()) + (1 << 20))
        try:
            save_file(cpu, str(tmp), metadata={"format": "pt"})
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise DsquantError(f"{tmp}: cannot write shard ({e})") from None
        os.replace(tmp, self.partial / name)
        return name

    def save_progress(self, next_layer: int, hidden: torch.Tensor, layer_stats: dict) -> None:
        """After layer next_layer - 1: its outputs (the next inputs) and its stats, atomically."""
        tmp = self.partial / (HIDDEN + ".tmp")
        save_file({"hidden": hidden.detach().contiguous().cpu()}, str(tmp))
        os.replace(tmp, self.partial / HIDDEN)
        self.state["next_layer"] = next_layer
        self.state["layers"][str(next_layer - 1)] = layer_stats
        _atomic_write_text(self.partial / STATE, json.dumps(self.state, indent=1))

    def load_hidden(self) -> torch.Tensor:
        return load_file(str(self.partial / HIDDEN))["hidden"]

    def weight_map(self) -> dict[str, str]:
        from safetensors import safe_open

        out = {}
        for i in range(self.total):
            name = self.shard_name(i)
            with safe_open(str(self.partial / name), "pt") as f:
                out.update({k: name for k in f.keys()})
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
