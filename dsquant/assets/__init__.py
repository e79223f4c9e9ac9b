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


def resolve_model_dir(arg: str) -> str:
    """A path as given, or a bundled model's directory when `arg` names one and no such path exists.
    Every command and the Python API (LLM) resolve a MODEL / ARTIFACT argument here."""
    import os

    if not os.path.exists(arg) and arg in BUNDLED_MODELS:
        return str(bundled_model_path(arg))
    if not os.path.exists(arg):
        import difflib

        close = difflib.get_close_matches(arg, BUNDLED_MODELS, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise DsquantError(f"{arg}: no such directory, nor a bundled model (bundled: {', '.join(BUNDLED_MODELS)})"
                           f"{hint}")
    return arg


def tokenizer_path() -> Path:
    """Directory of the bundled tokenizer (the same files sit in every bundled model dir)."""
    return ASSETS_DIR / "tokenizer"
