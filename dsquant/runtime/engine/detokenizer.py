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
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream


# tokens without a complete character before they are written out lossily: a UTF-8 character is at most 4
# bytes and a byte-level or byte-fallback token holds at least one, so 8 cannot still be completing one
MAX_STALLED = 8
KEEP = 3  # the last stalled tokens handed to the new stream: they may begin a valid character
CONTEXT = 4  # tokens that decoded, prefilled into a new stream (leading-space rules of some decoders)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer  # tokenizers.Tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)
        self.stalled: list[int] = []  # tokens stepped since the stream last returned text
        self.context: list[int] = []  # the last CONTEXT tokens whose text the stream returned
        self.token_ids: list[int] = []
        self.text = ""
        self.stop = [s for s in (stop or []) if s]
        self.stopped_on: str | None = None
        self.sent = 0  # characters of text already returned by add / flush

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
        if not self.stop:
            self.text += delta
            self.sent = len(self.text)
            return delta
        # a stop string may straddle the previous text and the delta
        combined = self.text + delta
        begin = max(0, len(self.text) - max(len(x) for x in self.stop) + 1)
        hits = sorted((i, x) for x in self.stop if (i := combined.find(x, begin)) >= 0)
        if hits:
            cut, self.stopped_on = hits[0]
            self.text = combined[:cut]
            return self.flush()
        self.text = combined
        end = len(self.text) - self._held()
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
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
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """The text held back so far (the request has ended): everything not yet returned."""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
