"""Read documents (plain strings) from the bundled text sets or a user's local source.

Accepted sources, all read offline:
  bundled name   "calibration", "eval_prose", "eval_code" (xz JSON Lines in dsquant/assets/data)
  .txt           one file, one document
  .jsonl         one JSON object per line with a string field "text" (also .jsonl.xz, .jsonl.gz)
  .parquet       a column "text", read through `datasets`
  directory      written by `datasets` `save_to_disk` (a Dataset, or a DatasetDict: its "train"
                 split, or its only split), with a column "text"

For calibration, long documents are cut at line ends into pieces of at most MAX_DOC_CHARS
characters, so that sampling one window never has to tokenize a whole book; evaluation streams
keep documents whole.
"""
import gzip
import json
import lzma
from pathlib import Path

from dsquant.errors import DsquantError

BUNDLED_DATA_DIR = Path(__file__).resolve().parent.parent / "assets" / "data"
BUNDLED_SETS = ("calibration", "eval_prose", "eval_code")
EVAL_SETS = ("eval_prose", "eval_code")
ACCEPTED_KINDS = (
    "a bundled set name (calibration, eval_prose, eval_code), a .txt file, a .jsonl/.jsonl.xz/"
    ".jsonl.gz file with a 'text' field, a .parquet file with a 'text' column, or a directory "
    "saved by datasets.save_to_disk with a 'text' column"
)
MAX_DOC_CHARS = 16_000


def bundled_path(name: str) -> Path:
    """The file of one bundled text set."""
    if name not in BUNDLED_SETS:
        raise DsquantError(f"unknown bundled text set {name!r}: expected one of {', '.join(BUNDLED_SETS)}")
    return BUNDLED_DATA_DIR / f"{name}.jsonl.xz"


def load_documents(source: str | Path, max_doc_chars: int | None = MAX_DOC_CHARS, column: str = "text",
                   split: str | None = None) -> list[str]:
    """All documents of `source` (see the module docstring) in file order; with `max_doc_chars`,
    longer ones are cut at line ends into pieces of about that size. `column`: the text field of
    a .jsonl, .parquet or dataset directory (not used for .txt); `split`: the split of a saved
    DatasetDict directory (default: train, or its only split)."""
    path = bundled_path(source) if isinstance(source, str) and source in BUNDLED_SETS else Path(source)
    docs = _read(path, column, split)
    if max_doc_chars:
        docs = [piece for doc in docs for piece in split_at_lines(doc, max_doc_chars)]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DsquantError(f"{path}: holds no text (expected at least one non-empty document)")
    return docs


def split_at_lines(text: str, max_chars: int) -> list[str]:
    """Cut `text` at line ends into pieces of at most about `max_chars` characters."""
    if len(text) <= max_chars:
        return [text]
    pieces, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        if current and size + len(line) > max_chars:
            pieces.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line)
    if current:
        pieces.append("".join(current))
    return pieces


def _read(path: Path, column: str = "text", split: str | None = None) -> list[str]:
    if not path.exists():
        raise DsquantError(f"{path}: no such file or directory (expected {ACCEPTED_KINDS})")
    name = path.name.lower()
    if path.is_dir():
        return _read_saved_dataset(path, column, split)
    if split is not None:
        raise DsquantError(f"{path}: a single file has no splits (a split is chosen in a directory saved by "
                           "datasets.save_to_disk as a DatasetDict)")
    if name.endswith(".txt"):
        return _read_txt(path)
    if name.endswith((".jsonl", ".jsonl.xz", ".jsonl.gz")):
        return _read_jsonl(path, column)
    if name.endswith(".parquet"):
        return _read_parquet(path, column)
    raise DsquantError(f"{path}: unsupported data source (expected {ACCEPTED_KINDS})")


def _read_txt(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8", errors="replace")
    return [text] if text.strip() else []


def _open_text(path: Path):
    name = path.name.lower()
    if name.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _read_jsonl(path: Path, column: str = "text") -> list[str]:
    docs = []
    try:
        with _open_text(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DsquantError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get(column), str):
                    raise DsquantError(f"{path}:{lineno}: expected a JSON object with a string field {column!r}")
                docs.append(record[column])
    except (lzma.LZMAError, OSError, UnicodeDecodeError) as e:
        raise DsquantError(f"{path}: could not be read as JSON Lines ({e})") from None
    return docs


def _text_column(path: Path, dataset, column: str = "text") -> list[str]:
    if column not in dataset.column_names:
        raise DsquantError(f"{path}: no {column!r} column (found columns: {', '.join(dataset.column_names)})")
    return [t for t in dataset[column] if isinstance(t, str)]


def _read_parquet(path: Path, column: str = "text") -> list[str]:
    import datasets  # heavy; only a parquet or saved-dataset source needs it

    try:
        dataset = datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
    except Exception as e:  # pyarrow raises several kinds for a corrupt file
        raise DsquantError(f"{path}: could not be read as parquet ({type(e).__name__}: {e})") from None
    return _text_column(path, dataset, column)


def _read_saved_dataset(path: Path, column: str = "text", split: str | None = None) -> list[str]:
    if not ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        raise DsquantError(
            f"{path}: a directory, but not one written by datasets.save_to_disk "
            f"(no dataset_info.json or dataset_dict.json; expected {ACCEPTED_KINDS})"
        )
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path), keep_in_memory=True)
    except Exception as e:
        raise DsquantError(f"{path}: could not be loaded by datasets.load_from_disk ({e})") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded.keys())
        if split is not None:
            if split not in loaded:
                raise DsquantError(f"{path}: no split {split!r} (splits: {', '.join(splits)})")
            loaded = loaded[split]
        elif "train" in loaded:
            loaded = loaded["train"]
        elif len(splits) == 1:
            loaded = loaded[splits[0]]
        else:
            raise DsquantError(f"{path}: a DatasetDict with splits {', '.join(splits)} and no 'train' split")
    elif split is not None and split != "train":
        raise DsquantError(f"{path}: a single Dataset, not a DatasetDict with a split {split!r}")
    return _text_column(path, loaded, column)
