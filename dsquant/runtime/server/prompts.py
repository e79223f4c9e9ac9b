"""Prompt text to token ids for the routes: bounded work, run off the event loop.

A prompt longer than max_model_len tokens is refused without encoding all of it: a token covers
at most `max_token_chars` characters (the longest vocabulary entry), so when a text is longer than
max_model_len * max_token_chars characters only that much of its head is encoded, and if the head
alone is over the limit the request is refused. The routes call `encode` and `render_chat`
through `asyncio.to_thread`; `encode_batch` is used because tokenizers releases the GIL in it
(plain `encode` holds the GIL, which would stall the event loop thread as well).

With add_special_tokens, a text that already starts with what the tokenizer adds (its BOS
token's text) is not given it twice: a prompt decoded from ids that held BOS (lm-eval's
`tokenized_requests=False`) tokenizes back to those ids.
"""
from __future__ import annotations

from dsquant.errors import DsquantError
from dsquant.runtime.server.api_errors import ApiError


class PromptEncoder:
    """Tokenize prompts and render chat templates for one artifact (thread-safe: no mutable state)."""

    def __init__(self, tokenizer, chat_template, max_model_len: int, path):
        self.tokenizer, self.chat_template, self.path = tokenizer, chat_template, path
        self.max_model_len = max_model_len
        longest = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1) if tokenizer else 1
        self.char_cap = max_model_len * max(longest, 1) + 64  # characters that surely fill max_model_len
        # what add_special_tokens puts before a text (e.g. [BOS]); [] for tokenizers that add nothing
        self.prefix = tokenizer.encode("", add_special_tokens=True).ids if tokenizer else []

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except (TypeError, ValueError, UnicodeError) as e:  # text the tokenizer cannot take
            raise ApiError(400, f"the prompt cannot be tokenized: {e}", "prompt") from None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, f"{self.path} has no tokenizer.json; send the prompt as token ids")
        if len(text) > self.char_cap:
            head = self._encode(text[:self.char_cap], add_special_tokens)
            if len(head) > self.max_model_len:
                raise ApiError(400, f"the prompt has {len(text)} characters, more than this model's "
                                    f"max_model_len {self.max_model_len} tokens", "prompt")
        ids = self._encode(text, add_special_tokens)
        k = len(self.prefix)
        if add_special_tokens and k and ids[:2 * k] == self.prefix * 2:  # the text itself starts with BOS
            ids = ids[k:]
        return ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ApiError(400, f"{self.path}/tokenizer_config.json has no chat_template; use /v1/completions")
        from jinja2 import TemplateError

        try:
            return self.chat_template.render(messages, add_generation_prompt)
        except (DsquantError, TemplateError) as e:
            raise ApiError(400, f"the messages do not fit the chat template: {e}", "messages") from None

    def chat_ids(self, messages: list[dict], add_special_tokens: bool = False,
                 add_generation_prompt: bool = True) -> list[int]:
        """The chat prompt's ids; add_special_tokens is off by default: the template writes BOS itself."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens)
