"""Build dsquant's bundled text data from the shared corpora.

    python scripts/build_data_assets.py --corpora /work/shared/corpora --out dsquant/assets/data

Writes:
  calibration.jsonl.xz  chunks drawn (seeded, deterministic) from train.jsonl.xz only, so the
                        evaluation sets stay held out
  eval_prose.jsonl.xz   verbatim copy of the corpora's eval_prose.jsonl.xz
  eval_code.jsonl.xz    verbatim copy of the corpora's eval_code.jsonl.xz
  LICENSES.md           the corpora README's sources-and-licenses table, which travels with the text

Each training document is cut at line boundaries into chunks of about CHUNK_CHARS characters;
a seeded `random.Random` picks chunks until TARGET_CHARS characters are drawn.
"""
import argparse
import json
import lzma
import random
import shutil
from pathlib import Path

from dsquant.data.sources import split_at_lines

CHUNK_CHARS = 6000
TARGET_CHARS = 3_000_000
SEED = 0


def draw_calibration(train_path: Path, seed: int) -> list[dict]:
    chunks = []
    with lzma.open(train_path, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)
            for i, piece in enumerate((split_at_lines(doc["text"], CHUNK_CHARS) if doc["text"] else [])):
                if len(piece) >= CHUNK_CHARS // 4:  # skip slivers (chapter tails, tiny modules)
                    chunks.append({"source": f"train:{doc['source']}#{i}", "text": piece})
    rng = random.Random(seed)
    rng.shuffle(chunks)
    drawn, total = [], 0
    for chunk in chunks:
        if total >= TARGET_CHARS:
            break
        drawn.append(chunk)
        total += len(chunk["text"])
    return drawn


def licenses_section(readme: str) -> str:
    start = readme.index("## Sources and licenses")
    return readme[start:].strip()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpora", type=Path, default=Path("/work/shared/corpora"))
    parser.add_argument("--out", type=Path, default=Path("dsquant/assets/data"))
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    drawn = draw_calibration(args.corpora / "train.jsonl.xz", args.seed)
    with lzma.open(args.out / "calibration.jsonl.xz", "wt", encoding="utf-8", preset=9) as f:
        for chunk in drawn:
            f.write(json.dumps(chunk, ensure_ascii=False) + "\n")
    for name in ("eval_prose", "eval_code"):
        shutil.copyfile(args.corpora / f"{name}.jsonl.xz", args.out / f"{name}.jsonl.xz")

    table = licenses_section((args.corpora / "README.md").read_text(encoding="utf-8"))
    n_chars = sum(len(c["text"]) for c in drawn)
    (args.out / "LICENSES.md").write_text(
        "# Bundled text: sources and licenses\n\n"
        "| file | what it holds |\n| --- | --- |\n"
        f"| calibration.jsonl.xz | {len(drawn)} chunks ({n_chars:,} characters) drawn with seed "
        f"{args.seed} by scripts/build_data_assets.py from the corpora's train.jsonl.xz only |\n"
        "| eval_prose.jsonl.xz | Pride and Prejudice and Persuasion (Jane Austen), one chapter per "
        "document; shares no text with the training file |\n"
        "| eval_code.jsonl.xz | CPython 3.11 `asyncio/`, `email/` and `json/` packages, one module "
        "per document; shares no text with the training file |\n\n"
        "The same text trained the bundled tokenizer and the reference models in "
        "dsquant/assets/models (training file only).\n\n" + table + "\n",
        encoding="utf-8",
    )
    print(f"calibration: {len(drawn)} chunks, {n_chars} characters -> {args.out}")


if __name__ == "__main__":
    main()
