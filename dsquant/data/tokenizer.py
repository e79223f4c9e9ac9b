"""Load a checkpoint's tokenizer exactly as its tokenizer.json defines it.

transformers 5's AutoTokenizer rebuilds some model types' tokenizers from their vocabulary with
its own pre-tokenizer: for `model_type: qwen2` (in its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)
it returns a Qwen2Tokenizer whose NFC normalizer and digit-splitting regex replace the ones in
tokenizer.json, so text tokenizes differently from how the model was trained (dsq-tiny-qwen2's
slice perplexity goes from 74 to 91). Loading tokenizer.json through PreTrainedTokenizerFast
keeps the file's pipeline; tokenizer_config.json still supplies the special tokens and chat
template.

The engine and the server encode and decode with the Rust `tokenizers.Tokenizer` underneath
(`backend_tokenizer`: its `encode_batch` releases the GIL, its `decode` takes `skip_special_tokens`);
they take it from the same load, so every part of dsquant tokenizes one way.
"""
from pathlib import Path

from dsquant.errors import DsquantError


def load_tokenizer(path: str | Path):
    """The tokenizer of a checkpoint or tokenizer directory, as its tokenizer.json defines it."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    if not path.is_dir():
        raise DsquantError(f"{path}: no such directory (expected a checkpoint or tokenizer directory)")
    if (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        raise DsquantError(
            f"{path}: no loadable tokenizer (expected tokenizer.json, or the files of a transformers tokenizer)"
        ) from None


def backend_tokenizer(path: str | Path):
    """load_tokenizer's tokenizers.Tokenizer, or None where `path` has no tokenizer.json.

    What the engine and server use; without it prompts must be token ids.
    """
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        return None
    return load_tokenizer(path).backend_tokenizer
