"""Prompts for `dsquant bench serve`: random token text or slices of a bundled text set.

- random: token ids drawn uniformly from the tokenizer's vocabulary (special tokens excluded),
  decoded to text, re-encoded and cut to `input_len` tokens, decoded again (as vLLM's random
  dataset does), so the text the server tokenizes is about `input_len` tokens long.
- corpus: windows of `input_len` tokens at random offsets of a text set's token stream (the
  bundled "eval_prose" by default, or any source `dsquant.data.load_documents` reads), decoded.

Without a tokenizer (a checkpoint with no tokenizer.json) random prompts are sent as token ids.
The server adds BOS to text prompts, so its `usage.prompt_tokens` is usually input_len + 1.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from dsquant.errors import DsquantError

DATASETS = ("random", "corpus")


@dataclass
class BenchPrompt:
    """One request's prompt: `text` when a tokenizer made it, else the raw `token_ids`."""

    token_ids: list[int]
    text: str | None = None

    @property
    def payload(self) -> str | list[int]:
        return self.text if self.text is not None else self.token_ids


@dataclass
class PromptSpec:
    dataset: str = "random"  # "random" | "corpus"
    num_prompts: int = 100
    input_len: int = 128
    seed: int = 0
    corpus: str = "eval_prose"  # the text set --dataset corpus slices


def load_bench_tokenizer(path: str | Path | None):
    """tokenizers.Tokenizer from `path`/tokenizer.json (default: the bundled one); None if absent."""
    from dsquant.assets import tokenizer_path
    from dsquant.data.tokenizer import backend_tokenizer

    directory = Path(path) if path is not None else tokenizer_path()
    if path is not None and not directory.is_dir():
        raise DsquantError(f"--tokenizer {path}: no such directory (expected one holding tokenizer.json)")
    return backend_tokenizer(directory)


def make_prompts(spec: PromptSpec, tokenizer, vocab_size: int | None = None) -> list[BenchPrompt]:
    """`spec.num_prompts` prompts of about `spec.input_len` tokens, the same for the same seed."""
    if spec.dataset not in DATASETS:
        raise DsquantError(f"--dataset {spec.dataset!r}: expected one of {', '.join(DATASETS)}")
    if spec.num_prompts < 1 or spec.input_len < 1:
        raise DsquantError(f"--num-prompts and --input-len must be at least 1, got {spec.num_prompts} and "
                           f"{spec.input_len}")
    rng = random.Random(spec.seed)
    if spec.dataset == "corpus":
        if tokenizer is None:
            raise DsquantError("--dataset corpus needs a tokenizer (the artifact has no tokenizer.json; "
                               "pass --tokenizer DIR)")
        return _corpus_prompts(spec, tokenizer, rng)
    if tokenizer is None:
        if vocab_size is None:
            raise DsquantError("random prompts without a tokenizer need the model's vocab size")
        return [BenchPrompt([rng.randrange(vocab_size) for _ in range(spec.input_len)])
                for _ in range(spec.num_prompts)]
    special = set(tokenizer.get_added_tokens_decoder())
    pool = [i for i in range(tokenizer.get_vocab_size()) if i not in special]
    return [_random_prompt(tokenizer, pool, spec.input_len, rng) for _ in range(spec.num_prompts)]


def _random_prompt(tokenizer, pool: list[int], input_len: int, rng: random.Random) -> BenchPrompt:
    ids = [rng.choice(pool) for _ in range(input_len)]
    for _ in range(4):  # decode/encode merges tokens: top up and cut until the text is input_len long
        ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False).ids
        if len(ids) == input_len:
            break
        ids = ids[:input_len] + [rng.choice(pool) for _ in range(input_len - len(ids))]
    text = tokenizer.decode(ids)
    return BenchPrompt(tokenizer.encode(text, add_special_tokens=False).ids, text)


def _corpus_prompts(spec: PromptSpec, tokenizer, rng: random.Random) -> list[BenchPrompt]:
    from dsquant.data.sources import BUNDLED_SETS, load_documents

    source = spec.corpus if spec.corpus in BUNDLED_SETS else Path(spec.corpus)
    docs = load_documents(source, max_doc_chars=None)
    rng.shuffle(docs)
    need = spec.num_prompts * spec.input_len
    stream: list[int] = []
    for doc in docs:  # enough documents for non-overlapping windows, when the set is that large
        stream += tokenizer.encode(doc, add_special_tokens=False).ids
        if len(stream) >= 2 * need:
            break
    if len(stream) < spec.input_len:
        raise DsquantError(f"--input-len {spec.input_len}: the corpus {spec.corpus} has only {len(stream)} tokens")
    prompts = []
    for _ in range(spec.num_prompts):
        start = rng.randrange(len(stream) - spec.input_len + 1)
        text = tokenizer.decode(stream[start:start + spec.input_len])
        prompts.append(BenchPrompt(tokenizer.encode(text, add_special_tokens=False).ids, text))
    return prompts
