"""Incremental detokenization and stop strings.

Decoding each step's token alone would split multi-byte characters and drop the spaces that
some decoders attach to the following token. tokenizers' DecodeStream keeps the window of tokens
that is still needed (its prefix and read offsets) on the Rust side and returns a token's text once
it is complete: one call per token, where decoding the window from Python took two decode calls
(5.2 against 0.74 us per token on this project's tokenizer, identical text on it and SmolLM2's over
the eval corpora and random ids). The text that could still become a stop string is held back too
(see `add`).
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer  # tokenizers.Tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)
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
        delta = "".join(piece for t in token_ids if (piece := self.stream.step(self.tokenizer, t)))
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
