"""Files beside a checkpoint's weights that the engine reads: the EOS ids (the tokenizer: dsquant.data.tokenizer)."""
from __future__ import annotations

import json
from pathlib import Path


def eos_ids(path: Path, cfg) -> set[int]:
    """EOS token ids from config.json's eos_token_id and generation_config.json's."""
    ids: set[int] = set()
    for source in (cfg.eos_token_id, _read_json(path / "generation_config.json").get("eos_token_id")):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(i for i in source if isinstance(i, int))
    return ids


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}

