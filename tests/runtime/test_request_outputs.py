"""A step's host work does not grow with output length: RequestOutput builds its cumulative fields
(token_ids, text, logprobs) when read, the detokenizer keeps its text in pieces and looks for stop
strings in a window, and block tables are staged from arrays converted incrementally. Each is
checked against what the eager forms gave: outputs read late equal outputs read at their step, the
windowed stop-string logic equals the whole-text one on random streams, and the staged tables equal
the lists."""
import random

import numpy as np
from tokenizers import Tokenizer

from dsquant.assets import tokenizer_path
from dsquant.runtime.engine.detokenizer import IncrementalDetokenizer
from dsquant.runtime.engine.sequence import SamplingParams, Sequence

from conftest import random_prompts
from test_async_scheduling import engine


class WholeTextDetokenizer(IncrementalDetokenizer):
    """The stop-string logic on the whole text (the form before the window): the reference."""

    def add(self, token_ids):
        if self.stopped_on is not None:
            return ""
        delta = "".join(self._step(t) for t in token_ids)
        if not delta:
            return ""
        text = self.whole
        if not self.stop:
            self.whole = text + delta
            self.sent = len(self.whole)
            return delta
        combined = text + delta
        begin = max(0, len(text) - max(len(x) for x in self.stop) + 1)
        hits = sorted((i, x) for x in self.stop if (i := combined.find(x, begin)) >= 0)
        if hits:
            cut, self.stopped_on = hits[0]
            self.whole = combined[:cut]
            return self.flush()
        self.whole = combined
        held = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(combined)), held, -1):
                if combined.endswith(stop[:k]):
                    held = k
                    break
        end = len(combined) - held
        out, self.sent = combined[self.sent:end], max(self.sent, end)
        return out

    def flush(self):
        out, self.sent = self.whole[self.sent:], len(self.whole)
        return out

    whole = ""


def test_windowed_stop_strings_equal_the_whole_text_logic_on_random_streams():
    """Random token streams over the bundled tokenizer; stop strings cut from the stream's own text
    (so they hit, often straddling two or more deltas, some held back first), plus ones that never
    appear and one-character ones. Every delta, flush, final text and stop equals the reference's,
    and text_upto(length after step k) is the text as it was at step k."""
    tok = Tokenizer.from_file(str(tokenizer_path() / "tokenizer.json"))
    rng = random.Random(0)
    corpus = tok.encode("the system to the children of the village, def f(x):\n    return x ** 2  # Grüße "
                        "世界 the end of the children's village system", add_special_tokens=False).ids
    hits = 0
    for trial in range(60):
        ids = [rng.choice(corpus) if rng.random() < 0.8 else rng.randrange(tok.get_vocab_size())
               for _ in range(rng.randrange(5, 60))]
        text = tok.decode(ids, skip_special_tokens=True)
        stops = []
        for _ in range(rng.randrange(0, 4)):
            if text and rng.random() < 0.7:
                a = rng.randrange(len(text))
                stops.append(text[a:a + rng.randrange(1, 12)])
            else:
                stops.append(rng.choice(["zzz-never", "\n\n\n", "q" * 9]))
        new, ref = IncrementalDetokenizer(tok, stops), WholeTextDetokenizer(tok, stops)
        seen = []
        for t in ids:
            assert new.add([t]) == ref.add([t]), (trial, stops)
            seen.append((new.length, ref.whole))
        assert new.flush() == ref.flush()
        assert new.text == ref.whole and new.stopped_on == ref.stopped_on, (trial, stops)
        hits += new.stopped_on is not None
        for length, whole_then in seen:
            if new.stopped_on is None or length <= new.cut:
                assert new.text_upto(length) == whole_then
    assert hits > 20  # most trials really stop, so the cut paths ran


def test_outputs_read_after_the_request_ends_equal_outputs_read_at_their_step(llama_with_tokenizer):
    """Async engine, logprobs and a stop string: each RequestOutput's token_ids, text and logprobs,
    read only after every request finished, equal what was read the moment the step returned
    them; they are not built until read."""
    from tokenizers import Tokenizer as Tok

    _, path = llama_with_tokenizer
    prompts = random_prompts(3, [6, 11, 8], seed=4, vocab=8192)
    eng = engine(path, True)
    eng.add_request(prompts[0], SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        outs = eng.step()
    text = Tok.from_file(str(path / "tokenizer.json")).decode(outs[-1].token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = [SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, stop=[stop], logprobs=2),
              SamplingParams(max_tokens=9, temperature=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)]
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    late, now = [], []
    while eng.has_unfinished():
        for out in eng.step():
            assert out.cumulative._token_ids is None and out.cumulative._text is None  # nothing built yet
            now.append((out.request_id, list(out.token_ids), out.text,
                        None if out.logprobs is None else list(out.logprobs)))
            out.cumulative._token_ids = out.cumulative._text = None  # read again below, from the sources
            late.append(out)
    assert [(o.request_id, o.token_ids, o.text, o.logprobs) for o in late] == now
    finals = {o.request_id: o for o in late if o.finished}
    assert finals[ids[0]].finish_reason == "stop" and stop not in finals[ids[0]].text
    assert all(len(finals[i].logprobs) == len(finals[i].token_ids) for i in (ids[0], ids[2]))


def test_block_table_array_follows_appends_and_a_freed_table():
    seq = Sequence(0, "r", [1, 2, 3], SamplingParams())
    rng = np.random.default_rng(0)
    for _ in range(3):
        for _ in range(int(rng.integers(1, 80))):
            seq.block_table.append(int(rng.integers(0, 1 << 20)))
            if rng.random() < 0.3:
                assert seq.block_table_array().tolist() == seq.block_table
        assert seq.block_table_array().tolist() == seq.block_table
        seq.block_table = []  # as BlockManager.free_seq leaves it
        assert seq.block_table_array().tolist() == []


def test_staged_block_tables_equal_the_padded_lists(tiny_models):
    """ModelRunner.prepare stages [n, width] block tables from the arrays: equal to the lists,
    each padded with block 0, for sequences of different lengths (one with a freed, regrown table)."""
    _, path = tiny_models["deepseek_v2"]
    eng = engine(path, False)
    prompts = random_prompts(3, [5, 30, 13], seed=2)
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    staged = []
    prepare = eng.runner.prepare

    def spy(batch):
        inputs = prepare(batch)
        ctx = inputs.ctx
        staged.append((ctx.block_tables.tolist(), [list(s.block_table) for s in batch.seqs]))
        return inputs

    eng.runner.prepare = spy
    while eng.has_unfinished():
        eng.step()
    assert staged
    for table, lists in staged:
        width = max(map(len, lists))
        assert table == [b + [0] * (width - len(b)) for b in lists]


def _streams(tok, rng, n):
    """Random token streams over the bundled tokenizer: mostly a corpus's tokens, some random ids (lone
    bytes among them, which stall the stream until the lossy write-out), cut into bursts of 1-8."""
    corpus = tok.encode("the children of the village, def f(x):\n    return x ** 2  # Grüße 世界 end",
                        add_special_tokens=False).ids
    for _ in range(n):
        ids = [rng.choice(corpus) if rng.random() < 0.7 else rng.randrange(tok.get_vocab_size())
               for _ in range(rng.randrange(1, 80))]
        bursts, i = [], 0
        while i < len(ids):
            k = rng.randrange(1, 9)
            bursts.append(ids[i:i + k])
            i += k
        yield bursts


def test_lazy_detokenizer_gives_the_eager_text_however_it_is_read():
    """Without stop strings the engine defers decoding (outputs.LazyDelta): each burst's delta, the text
    length after each burst and the final text equal the eager detokenizer's, whether the deltas are
    read at their step, later in any order, or never (only the final text)."""
    tok = Tokenizer.from_file(str(tokenizer_path() / "tokenizer.json"))
    rng = random.Random(1)
    for trial, bursts in enumerate(_streams(tok, rng, 80)):
        eager = IncrementalDetokenizer(tok)
        want = [eager.add(b) for b in bursts]
        lengths, total = [], 0
        for d in want:
            total += len(d)
            lengths.append(total)
        mode = trial % 3
        lazy = IncrementalDetokenizer(tok, lazy=True)
        assert lazy.lazy and not IncrementalDetokenizer(tok, ["x"], lazy=True).lazy  # stop strings: eager
        marks, got = [0], {}
        for k, b in enumerate(bursts):
            marks.append(lazy.defer(b))
            if mode == 0:
                got[k] = lazy.delta(marks[k], marks[k + 1])
        assert lazy._done == (len(lazy.token_ids) if mode == 0 else 0)  # nothing decoded until read
        if mode == 1:
            for k in rng.sample(range(len(bursts)), len(bursts)):
                got[k] = lazy.delta(marks[k], marks[k + 1])
        if mode != 2:
            assert [got[k] for k in range(len(bursts))] == want, trial
        assert lazy.text == eager.text and lazy.length == len(eager.text), trial
        assert [lazy.length_at(m) for m in marks[1:]] == lengths, trial
        assert lazy.flush() == ""


def test_lazy_deltas_read_on_another_thread_while_tokens_are_deferred():
    """The server reads deltas on its HTTP thread while the engine thread defers the next tokens."""
    import queue
    import threading

    tok = Tokenizer.from_file(str(tokenizer_path() / "tokenizer.json"))
    rng = random.Random(2)
    for bursts in _streams(tok, rng, 20):
        eager = IncrementalDetokenizer(tok)
        want = "".join(eager.add(b) for b in bursts)
        lazy, q, got = IncrementalDetokenizer(tok, lazy=True), queue.Queue(), []

        def reader():
            while (item := q.get()) is not None:
                got.append(lazy.delta(*item))

        t = threading.Thread(target=reader)
        t.start()
        start = 0
        for b in bursts:
            end = lazy.defer(b)
            q.put((start, end))
            start = end
        q.put(None)
        t.join()
        assert "".join(got) == want == lazy.text


def test_engine_defers_the_text_of_requests_without_stop_strings(llama_with_tokenizer):
    """A request without stop strings gets LazyDelta outputs and nothing is decoded while it runs;
    its deltas, read afterwards, join to its final text, which is the tokenizer's decode of its tokens.
    A request with a stop string is detokenized at each step (its stop check needs the text)."""
    from tokenizers import Tokenizer as Tok

    from dsquant.runtime.engine.outputs import LazyDelta

    _, path = llama_with_tokenizer
    tok = Tok.from_file(str(path / "tokenizer.json"))
    prompts = random_prompts(2, [7, 9], seed=5, vocab=8192)
    eng = engine(path, True)
    plain = eng.add_request(prompts[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    stopped = eng.add_request(prompts[1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                         stop=["zzz-never"]))
    detoks = {r: eng.requests[r][1] for r in (plain, stopped)}
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert detoks[plain]._done == 0 and detoks[stopped]._done == 0 and len(detoks[stopped]._pieces) > 0
    mine = [o for o in outs if o.request_id == plain]
    assert all(isinstance(o.delta, LazyDelta) for o in mine)
    assert all(isinstance(o.delta, str) for o in outs if o.request_id == stopped)
    assert "".join(o.delta_text for o in mine) == mine[-1].text == tok.decode(mine[-1].token_ids,
                                                                               skip_special_tokens=True)
    assert [o.text for o in mine] == ["".join(x.delta_text for x in mine[:k + 1]) for k in range(len(mine))]
