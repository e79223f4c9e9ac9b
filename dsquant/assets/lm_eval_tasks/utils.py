"""Loader for dsquant's bundled lm-evaluation-harness tasks: the JSON Lines file next to this one.

lm-eval calls `load(**metadata, **dataset_kwargs)` (the YAML's `custom_dataset`), so the data
is found relative to this file wherever dsquant is installed, and nothing is downloaded.
"""
from pathlib import Path


def load(file: str, **_):
    import datasets

    path = Path(__file__).resolve().parent / file
    return datasets.DatasetDict({"test": datasets.load_dataset("json", data_files=str(path), split="train")})
