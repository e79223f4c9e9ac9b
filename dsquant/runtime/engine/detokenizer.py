"""Incremental detokenization and stop strings.

Decoding each step's token alone would split multi-byte characters and drop the spaces that
some decoders attach to the following token. tokenizers' DecodeStream keeps the window of tokens
that is still needed (its prefix and read offsets) on the Rust side and returns a token's text once
it is complete: one call per token, where decoding the window from Python took two decode calls
(5.2 against 0.74 us per token on this project's tokenizer, identical text on it and SmolLM2's over
the eval corpora and random ids). The text that could still become a stop string is held back too
(see `add`).

A stream also keeps every token that has not yet completed a character, and re-decodes all of them
at each step: a model that emits tokens which never form valid UTF-8 (a run of lone byte tokens, or
ids past the tokenizer's vocabulary: a broken quantization, a random-weight benchmark model) made
each step cost more than the last (2000 such tokens: 290 us a token against 0.6). So after
MAX_STALLED tokens without text, all but the last KEEP of them are written out as the tokenizer's
lossy decode (U+FFFD for invalid bytes, as `tokenizer.decode` gives), and a new stream, prefilled
with the last tokens that did decode, takes the kept tail (which may still start a valid character).

Lazy mode (`lazy=True`, only without stop strings, where no check needs the text at each step): the
engine hands each step's tokens to `defer`, which only records them and returns a mark (the token count
so far); the text is decoded when first asked for (`delta(start, end)`, `length_at(mark)`, `text`),
through the same stream, mark by mark, so it is the text `add` would have given. A reader on another
thread (the server's HTTP loop) may decode while the engine defers more tokens: a lock orders the two.
"""
from __future__ import annotations

import threading
from collections import deque

from tokenizers.decoders import DecodeStream


# tokens without a complete character before they are written out lossily: a UTF-8 character is at most 4
# bytes and a byte-level or byte-fallback token holds at least one, so 8 cannot still be completing one
MAX_STALLED = 8
KEEP = 3  # the last stalled tokens handed to the new stream: they may begin a valid character
CONTEXT = 4  # tokens that decoded, prefilled into a new stream (leading-space rules of some decoders)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None, lazy: bool = False):
        self.tokenizer = tokenizer  # tokenizers.Tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)
        self.stalled: list[int] = []  # tokens stepped since the stream last returned text
        self.context: list[int] = []  # the last CONTEXT tokens whose text the stream returned
        self.token_ids: list[int] = []
        self.stop = [s for s in (stop or []) if s]
        self.stopped_on: str | None = None
        self.sent = 0  # characters of text already returned by add / flush
        # The text is kept as the pieces `add` appended and joined only when read (`text`,
        # `text_upto`): a step's work does not grow with the length of the text so far.
        self._pieces: list[str] = []
        self._length = 0  # characters in _pieces
        self.cut: int | None = None  # where the stop string begins: the text ends there
        # a stop string can straddle the text's last _keep characters and a new delta; _window holds
        # the last delta with the _keep characters before it, starting at character _w0 of the text
        self._keep = max(map(len, self.stop)) - 1 if self.stop else 0
        self._window, self._w0 = "", 0
        # lazy mode: token_ids[:_done] decoded; _marks: the counts defer returned, not yet decoded;
        # _lengths: count -> text length after it; _deltas: count -> the text since the mark before
        self.lazy = lazy and not self.stop
        self._done = 0
        self._marks: deque[int] = deque()
        self._lengths: dict[int, int] = {0: 0}
        self._deltas: dict[int, str] = {}
        self._lock = threading.Lock() if self.lazy else None

    @property
    def length(self) -> int:
        """Characters of the text (up to the stop string, once one appeared)."""
        if self.lazy:
            return self.length_at(len(self.token_ids))
        return self._length if self.cut is None else self.cut

    def defer(self, token_ids: list[int]) -> int:
        """Lazy mode: append tokens without decoding them; the mark to read their text by."""
        with self._lock:
            self.token_ids.extend(token_ids)
            mark = len(self.token_ids)
            if mark not in self._lengths and (not self._marks or self._marks[-1] != mark):
                self._marks.append(mark)
            return mark

    def length_at(self, mark: int) -> int:
        """Lazy mode: the text's length after its first `mark` tokens (a mark `defer` returned, or 0)."""
        if self._lengths.get(mark) is None:
            self._decode_upto(mark)
        return self._lengths[mark]

    def delta(self, start: int, end: int) -> str:
        """Lazy mode: the text of tokens [start, end), two marks (the second returned by the
        defer call after the first)."""
        self._decode_upto(end)
        piece = self._deltas.pop(end, None)  # read once, by the output of that step
        if piece is not None and self._lengths[end] - len(piece) == self._lengths[start]:
            return piece
        return self.text_upto(self._lengths[end])[self._lengths[start]:]

    def _decode_upto(self, mark: int) -> None:
        with self._lock:
            while self._marks and self._marks[0] <= mark:
                end = self._marks.popleft()
                piece = "".join(self._step(t) for t in self.token_ids[self._done:end])
                if piece:
                    self._pieces.append(piece)
                    self._length += len(piece)
                self._done, self._lengths[end], self._deltas[end] = end, self._length, piece
            if mark not in self._lengths:
                raise ValueError(f"detokenizer: {mark} is not a mark of this request's tokens")

    @property
    def text(self) -> str:
        return self.text_upto(self.length)

    def text_upto(self, n: int) -> str:
        """The first n characters of the text as added (before any cut at a stop string): what
        `text` was when `length` was n."""
        if len(self._pieces) > 1:
            if self._lock is None:
                self._pieces = ["".join(self._pieces)]
            else:
                with self._lock:  # a decode on another thread may be appending
                    self._pieces = ["".join(self._pieces)]
        whole = self._pieces[0] if self._pieces else ""
        return whole if n >= len(whole) else whole[:n]

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly readable text (cut before a stop string if one appears).

        With stop strings, a tail of the text that could still grow into one is held back (as
        vLLM does), so a streaming client never sees the start of a stop string; it is released
        once it cannot (or by `flush` when the request ends otherwise)."""
        if self.stopped_on is not None:
            return ""
        self.token_ids.extend(token_ids)
        delta = "".join(self._step(t) for t in token_ids)
        if not delta:
            return ""
        start = self._length
        self._pieces.append(delta)
        self._length += len(delta)
        if not self.stop:
            self.sent = self._length
            return delta
        # the window covers every position a stop string touching the delta can start at
        tail = self._window[-self._keep:] if self._keep else ""
        self._window, self._w0 = tail + delta, start - len(tail)
        hits = sorted((i, x) for x in self.stop if (i := self._window.find(x)) >= 0)
        if hits:
            i, self.stopped_on = hits[0]
            self.cut = self._w0 + i
            return self.flush()
        end = self._length - self._held()
        out = self._window[self.sent - self._w0:end - self._w0] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def _step(self, token: int) -> str:
        """The text `token` completes ('' while it completes no character)."""
        piece = self.stream.step(self.tokenizer, token)
        if piece is not None:
            self.context = (self.context + self.stalled + [token])[-CONTEXT:]
            self.stalled = []
            return piece
        self.stalled.append(token)
        if len(self.stalled) < MAX_STALLED:
            return ""
        lost, tail = self.stalled[:-KEEP], self.stalled[-KEEP:]
        base, full = self._decode(self.context), self._decode(self.context + lost)
        text = full[len(base):] if full.startswith(base) else self._decode(lost)
        self.stream = DecodeStream(ids=self.context or None, skip_special_tokens=True)
        self.stalled = []
        return text + "".join(self._step(t) for t in tail)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string (the
        window holds the text's last _keep characters, or all of it)."""
        best, w = 0, self._window
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(w)), best, -1):
                if w.endswith(stop[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """The text held back so far (the request has ended): everything not yet returned. It lies
        in the window: what add held back is shorter than a stop string."""
        if self.lazy:
            return ""  # nothing is held back without stop strings
        end = self.length
        if end <= self.sent:
            return ""
        out, self.sent = self._window[self.sent - self._w0:end - self._w0], end
        return out
