"""Files shipped inside the package: the bundled tokenizer, text sets and trained models.

dsquant/assets/
  tokenizer/          byte-level BPE, vocabulary 8192 (scripts/train_tokenizer.py)
  data/               calibration.jsonl.xz, eval_prose.jsonl.xz, eval_code.jsonl.xz, LICENSES.md
  models/<name>/      transformers checkpoints trained by scripts/train_reference.py, each with a
                      MODEL_CARD.md
"""
from pathlib import Path

from dsquant.errors import DsquantError

ASSETS_DIR = Path(__file__).resolve().parent
BUNDLED_MODELS = ("dsq-tiny-v3", "dsq-tiny-qwen2")


def bundled_model_path(name: str) -> Path:
    """Directory of a bundled model (config.json, safetensors shards, tokenizer, MODEL_CARD.md)."""
    if name not in BUNDLED_MODELS:
        raise DsquantError(f"unknown bundled model {name!r}: expected one of {', '.join(BUNDLED_MODELS)}")
    path = ASSETS_DIR / "models" / name
    if not (path / "config.json").exists():
        raise DsquantError(f"{path}: bundled model {name} is missing its config.json (a broken install?)")
    return path


def bundled_models() -> list[str]:
    """Names of the bundled models present in this install."""
    return [name for name in BUNDLED_MODELS if (ASSETS_DIR / "models" / name / "config.json").exists()]


def tokenizer_path() -> Path:
    """Directory of the bundled tokenizer (the same files sit in every bundled model dir)."""
    return ASSETS_DIR / "tokenizer"
