"""dsquant.data: calibration samples, evaluation streams, user sources and their errors."""
import json
import math

import pytest
import torch

from dsquant.assets import tokenizer_path
from dsquant.data import (
    bundled_path,
    calibration_samples,
    eval_tokens,
    load_documents,
    load_tokenizer,
    sliding_window_perplexity,
    sliding_windows,
)
from dsquant.data.encoding import encode_documents
from dsquant.errors import DsquantError

# Token n-grams of 32 (about 110 characters): 24-grams already match idioms that independent
# modules share (weekday-name lists, __exit__ boilerplate), which are not evaluation text.
NGRAM = 32


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(tokenizer_path())


@pytest.fixture(scope="module")
def eval_ngrams(tokenizer):
    grams = set()
    for name in ("eval_prose", "eval_code"):
        stream = eval_tokens(tokenizer, name).tolist()
        grams.update(tuple(stream[i : i + NGRAM]) for i in range(len(stream) - NGRAM + 1))
    return grams


def overlap(rows: list[list[int]], grams: set) -> float:
    """Fraction of the rows' token n-grams that also occur in `grams`."""
    hits = total = 0
    for row in rows:
        for i in range(len(row) - NGRAM + 1):
            total += 1
            hits += tuple(row[i : i + NGRAM]) in grams
    return hits / total


def test_bundled_tokenizer_is_a_transformers_tokenizer_with_chat_template(tokenizer):
    config = json.loads((tokenizer_path() / "tokenizer_config.json").read_text())
    assert "chat_template" in config
    assert len(tokenizer) == 8192
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    text = "def f(x):\n    return x  # café"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text  # byte-level: lossless
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.startswith(tokenizer.bos_token) and "hi" in chat


def test_load_tokenizer_errors_name_the_path(tmp_path):
    with pytest.raises(DsquantError, match=r"missing_dir: no such directory"):
        load_tokenizer(tmp_path / "missing_dir")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DsquantError, match=r"empty_dir: no loadable tokenizer \(expected tokenizer\.json"):
        load_tokenizer(tmp_path / "empty_dir")


def test_calibration_samples_have_the_requested_shape(tokenizer):
    samples = calibration_samples(tokenizer, n_samples=16, seqlen=256)
    assert samples.shape == (16, 256) and samples.dtype == torch.long
    assert int(samples.min()) >= 0 and int(samples.max()) < len(tokenizer)
    assert len({tuple(row) for row in samples.tolist()}) == 16  # drawn from different places


def test_calibration_samples_are_deterministic_for_a_seed(tokenizer):
    a = calibration_samples(tokenizer, n_samples=8, seqlen=128, seed=3)
    b = calibration_samples(tokenizer, n_samples=8, seqlen=128, seed=3)
    c = calibration_samples(tokenizer, n_samples=8, seqlen=128, seed=4)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_calibration_samples_never_contain_evaluation_text(tokenizer, eval_ngrams):
    for seed in (0, 1):
        samples = calibration_samples(tokenizer, n_samples=128, seqlen=512, seed=seed)
        assert overlap(samples.tolist(), eval_ngrams) == 0.0
    # The check can fail: samples drawn from an evaluation file overlap completely.
    leaked = calibration_samples(tokenizer, n_samples=8, seqlen=512, source=bundled_path("eval_code"))
    assert overlap(leaked.tolist(), eval_ngrams) > 0.99


def test_bundled_calibration_file_shares_no_text_with_evaluation_sets(tokenizer, eval_ngrams):
    docs = encode_documents(tokenizer, load_documents("calibration"))
    assert overlap(docs, eval_ngrams) == 0.0


def test_bundled_eval_names_are_not_calibration_sources(tokenizer):
    with pytest.raises(DsquantError, match="eval_prose: no such file"):
        calibration_samples(tokenizer, n_samples=1, seqlen=16, source="eval_prose")


def _decoded_inside(tokenizer, samples: torch.Tensor, text: str) -> bool:
    """Every stretch of each sample between BOS/EOS markers decodes to a piece of `text`."""
    specials = {tokenizer.bos_token_id, tokenizer.eos_token_id}
    for row in samples.tolist():
        segment = []
        for tok in row + [tokenizer.eos_token_id]:
            if tok not in specials:
                segment.append(tok)
                continue
            if segment and tokenizer.decode(segment) not in text:
                return False
            segment = []
    return True


@pytest.fixture
def user_text() -> str:
    lines = [f"Line {i}: the quick brown fox {i * 7919 % 1000} jumps over the lazy dog." for i in range(400)]
    return "\n".join(lines) + "\n"


def test_txt_and_jsonl_sources(tokenizer, tmp_path, user_text):
    txt = tmp_path / "corpus.txt"
    txt.write_text(user_text)
    jsonl = tmp_path / "corpus.jsonl"
    halves = [user_text[: len(user_text) // 2], user_text[len(user_text) // 2 :]]
    jsonl.write_text("".join(json.dumps({"text": h, "id": i}) + "\n" for i, h in enumerate(halves)))
    for source in (txt, jsonl, str(jsonl)):
        samples = calibration_samples(tokenizer, n_samples=4, seqlen=64, source=source)
        assert samples.shape == (4, 64)
        assert _decoded_inside(tokenizer, samples, user_text)


def test_parquet_and_saved_dataset_sources(tokenizer, tmp_path, user_text):
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"text": [user_text[:5000], user_text[5000:]], "label": [0, 1]})
    dataset.to_parquet(str(tmp_path / "corpus.parquet"))
    dataset.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": dataset, "test": dataset}).save_to_disk(str(tmp_path / "saved_dict"))
    for source in ("corpus.parquet", "saved", "saved_dict"):
        samples = calibration_samples(tokenizer, n_samples=3, seqlen=64, seed=1, source=tmp_path / source)
        assert samples.shape == (3, 64)
        assert _decoded_inside(tokenizer, samples, user_text)


def test_bad_sources_give_errors_naming_the_path_and_what_was_expected(tokenizer, tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DsquantError, match=r"nope\.jsonl: no such file.*\.txt.*\.parquet"):
        calibration_samples(tokenizer, source=missing)
    csv = tmp_path / "data.csv"
    csv.write_text("text\nhello\n")
    with pytest.raises(DsquantError, match=r"data\.csv: unsupported data source \(expected .*\.jsonl"):
        calibration_samples(tokenizer, source=csv)
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DsquantError, match=r"nofield\.jsonl:2: expected a JSON object with a string field 'text'"):
        calibration_samples(tokenizer, source=no_field)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(DsquantError, match=r"broken\.jsonl:1: not valid JSON"):
        calibration_samples(tokenizer, source=broken)
    plain_dir = tmp_path / "plain_dir"
    plain_dir.mkdir()
    with pytest.raises(DsquantError, match=r"plain_dir: a directory, but not one written by datasets\.save_to_disk"):
        calibration_samples(tokenizer, source=plain_dir)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("only a few words")
    with pytest.raises(DsquantError, match=r"tiny\.txt: holds \d+ tokens in all, fewer than one calibration sample"):
        calibration_samples(tokenizer, n_samples=2, seqlen=512, source=tiny)


def test_parquet_without_text_column_names_the_columns(tokenizer, tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": ["a b c"]}).to_parquet(str(tmp_path / "x.parquet"))
    with pytest.raises(DsquantError, match=r"x\.parquet: no 'text' column \(found columns: body\)"):
        calibration_samples(tokenizer, source=tmp_path / "x.parquet")


def test_eval_stream_frames_each_document_and_decodes_to_it(tokenizer):
    docs = load_documents("eval_code", max_doc_chars=None)
    stream = eval_tokens(tokenizer, "eval_code")
    assert int((stream == tokenizer.bos_token_id).sum()) == len(docs)
    assert int((stream == tokenizer.eos_token_id).sum()) == len(docs)
    first_end = int((stream == tokenizer.eos_token_id).nonzero()[0])
    assert tokenizer.decode(stream[1:first_end].tolist()) == docs[0]
    assert eval_tokens(tokenizer, "eval_prose", max_tokens=100).numel() == 100
    with pytest.raises(DsquantError, match="eval_poetry: no such file"):
        eval_tokens(tokenizer, "eval_poetry")


@pytest.mark.parametrize("n_tokens,window,stride", [(2048, 512, 256), (1000, 512, 256), (700, 128, 127), (5, 512, 100)])
def test_sliding_windows_score_every_target_once_with_enough_context(n_tokens, window, stride):
    windows = sliding_windows(n_tokens, window, stride)
    scored = []
    for w in windows:
        assert w.end - w.start <= window
        first_target = w.end - w.n_scored
        assert first_target >= w.start + 1  # a window cannot predict its own first token
        if w.start > 0:
            assert first_target - w.start >= window - stride  # context before the first scored target
        scored.extend(range(first_target, w.end))
    assert scored == list(range(1, n_tokens))


@pytest.mark.parametrize("stride", [0, 512, 600])
def test_sliding_windows_refuse_a_stride_that_leaves_targets_unpredicted(stride):
    with pytest.raises(DsquantError, match="0 < stride < window"):
        sliding_windows(2048, 512, stride)


def test_sliding_window_perplexity_scores_the_right_targets():
    tokens = torch.randint(0, 50, (1500,), generator=torch.Generator().manual_seed(0))
    uniform = sliding_window_perplexity(lambda ids: torch.zeros(*ids.shape, 50), tokens, 512, 256, batch_size=3)
    assert math.isclose(uniform.value, 50.0, rel_tol=1e-6) and uniform.n_scored == 1499

    def oracle(ids):  # puts all mass on the true next token: perplexity 1 only if targets line up
        logits = torch.full((*ids.shape, 50), -1e4)
        starts = [int((tokens.unfold(0, ids.shape[1], 1) == row).all(1).nonzero()[0]) for row in ids]
        for b, start in enumerate(starts):
            nxt = tokens[start + 1 : start + ids.shape[1] + 1]
            logits[b, torch.arange(nxt.numel()), nxt] = 0.0
        return logits

    assert sliding_window_perplexity(oracle, tokens, 512, 256, batch_size=2).value == pytest.approx(1.0)
