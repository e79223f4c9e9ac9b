"""Build the JSON Lines data of dsquant's bundled lm-evaluation-harness tasks.

    python scripts/build_lm_eval_tasks.py --out dsquant/assets/lm_eval_tasks

Reads only the bundled evaluation split (dsquant/assets/data/eval_prose.jsonl.xz: Pride and
Prejudice and Persuasion), never the calibration/training text, and writes:

  dsq_prose_cloze.jsonl   {"context", "target"}: a passage cut before the last word of a
                          sentence; the target is that word (LAMBADA-style next-word prediction)
  dsq_prose_choice.jsonl  {"context", "choices", "label"}: a passage ending at a sentence end;
                          four candidate next sentences, the true one and three drawn from other
                          chapters (HellaSwag-style multiple choice)

Whitespace runs (the novels' hard line wraps) are folded into single spaces. Examples are drawn
with a seeded random.Random, spread over all chapters, N_EXAMPLES per file.
"""
import argparse
import json
import random
import re
from pathlib import Path

from dsquant.data.sources import load_documents

N_EXAMPLES = 200
CONTEXT_CHARS = 400  # about 100 tokens of the bundled tokenizer
SEED = 0
SENTENCE_END = re.compile(r'(?<=[.!?])["\u201d]?\s+(?=["\u201c]?[A-Z])')
LAST_WORD = re.compile(r"^(.*\S) ([A-Za-z]{3,})([.!?]|[.!?][\"\u201d])$")


ABBREVIATIONS = ("Mr.", "Mrs.", "Dr.", "St.")


def sentences(doc: str) -> list[str]:
    out: list[str] = []
    for piece in SENTENCE_END.split(" ".join(doc.split())):
        if out and out[-1].endswith(ABBREVIATIONS):  # "Mrs. Hurst" is not a sentence end
            out[-1] += " " + piece
        elif piece:
            out.append(piece)
    return out


def _tail(text: str, chars: int) -> str:
    """The last ~chars characters of text, starting at a word boundary."""
    if len(text) <= chars:
        return text
    cut = text[-chars:]
    return cut[cut.find(" ") + 1:] if " " in cut else cut


def cloze_examples(chapters: list[list[str]], rng: random.Random) -> list[dict]:
    pool = []
    for c, sents in enumerate(chapters):
        for i, s in enumerate(sents[3:], start=3):
            m = LAST_WORD.match(s)
            if m:
                pool.append((c, i, m.group(1), m.group(2)))
    out = []
    for c, i, head, word in sorted(rng.sample(pool, N_EXAMPLES)):
        before = " ".join(chapters[c][:i])
        out.append({"id": f"cloze-{c}-{i}", "context": _tail(before + " " + head, CONTEXT_CHARS), "target": word})
    return out


def choice_examples(chapters: list[list[str]], rng: random.Random) -> list[dict]:
    spots = [(c, i) for c, sents in enumerate(chapters) for i in range(3, len(sents) - 1)
             if 30 <= len(sents[i + 1]) <= 300]
    out = []
    for c, i in sorted(rng.sample(spots, N_EXAMPLES)):
        true = chapters[c][i + 1]
        others = []
        while len(others) < 3:
            c2 = rng.randrange(len(chapters))
            if c2 == c:
                continue
            s = rng.choice(chapters[c2])
            if 0.5 * len(true) <= len(s) <= 2 * len(true) and s not in others:
                others.append(s)
        choices = [true] + others
        rng.shuffle(choices)
        out.append({"id": f"choice-{c}-{i}", "context": _tail(" ".join(chapters[c][:i + 1]), CONTEXT_CHARS),
                    "choices": choices, "label": choices.index(true)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="dsquant/assets/lm_eval_tasks")
    args = ap.parse_args()
    chapters = [sentences(d) for d in load_documents("eval_prose", max_doc_chars=None)]
    out = Path(args.out)
    for name, build in (("dsq_prose_cloze", cloze_examples), ("dsq_prose_choice", choice_examples)):
        rows = build(chapters, random.Random(SEED))
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        print(f"{path}: {len(rows)} examples, {path.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
