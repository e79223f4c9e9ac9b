"""Incremental detokenization and stop strings.

Decoding each step's token alone would split multi-byte characters and drop the spaces that
some decoders attach to the following token, so the text is decoded over a window: tokens
[prefix_offset, read_offset) were already emitted, and the new text is what decoding
[prefix_offset, end) adds beyond them, held back while it ends in an incomplete character.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer  # tokenizers.Tokenizer (decode(ids, skip_special_tokens=...))
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop = [s for s in (stop or []) if s]
        self.stopped_on: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly readable text (cut before a stop string if one appears)."""
        self.token_ids.extend(token_ids)
        before = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) <= len(before) or full.endswith(REPLACEMENT):
            return ""
        delta = full[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        if self.stop:
            # a stop string may straddle the previous text and the delta
            lookback = max(len(s) for s in self.stop) - 1
            start = max(0, len(self.text) - lookback)
            window = self.text[start:] + delta
            cut = min((i for i in (window.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.stopped_on = next(s for s in self.stop if window.find(s) == cut)
                keep = start + cut  # absolute length of the text to keep
                delta = (self.text + delta)[len(self.text):keep] if keep > len(self.text) else ""
                self.text = self.text[:keep] if keep < len(self.text) else self.text + delta
                return delta
        self.text += delta
        return delta
