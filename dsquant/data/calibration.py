"""Calibration samples: fixed-length token windows drawn deterministically from a text source.

Each sample comes from the next document of a seeded permutation (documents shorter than
`seqlen` are joined with the following ones), at a seeded random offset inside it, so the
samples spread over many documents rather than one long run of text.
"""
from pathlib import Path

import torch

from dsquant.data.encoding import encode_documents
from dsquant.data.sources import load_documents
from dsquant.errors import DsquantError


def calibration_samples(
    tokenizer,
    n_samples: int = 128,
    seqlen: int = 512,
    seed: int = 0,
    source: str | Path | None = None,
    column: str = "text",
    split: str | None = None,
) -> torch.Tensor:
    """Token windows for calibration: LongTensor [n_samples, seqlen], the same for the same seed.

    source: None for the bundled calibration set (drawn from the training corpus only), else a
    local .txt, .jsonl, .parquet file or a `datasets` save_to_disk directory; `column` and
    `split` pick its text field and its split (sources.load_documents).
    """
    if n_samples < 1 or seqlen < 2:
        raise DsquantError(f"calibration needs n_samples >= 1 and seqlen >= 2 (got {n_samples}, {seqlen})")
    # A user's source is always a path: bundled evaluation sets cannot be named by accident.
    name = "calibration" if source is None else Path(source)
    docs = load_documents(name, column=column, split=split)
    generator = torch.Generator().manual_seed(seed)
    samples: list[list[int]] = []
    while len(samples) < n_samples:
        # One pass over a fresh permutation; a partial buffer is dropped at the pass's end.
        order = torch.randperm(len(docs), generator=generator).tolist()
        buffer: list[int] = []  # tokens of the documents joined so far for the next sample
        made = 0
        for index in order:
            buffer.extend(encode_documents(tokenizer, [docs[index]])[0])
            if len(buffer) >= seqlen:
                start = int(torch.randint(0, len(buffer) - seqlen + 1, (1,), generator=generator))
                samples.append(buffer[start : start + seqlen])
                buffer, made = [], made + 1
                if len(samples) == n_samples:
                    break
        if made == 0:
            raise DsquantError(
                f"{name}: holds {len(buffer)} tokens in all, fewer than one calibration sample "
                f"of seqlen={seqlen}"
            )
    return torch.tensor(samples, dtype=torch.long)
