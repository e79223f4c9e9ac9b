"""The chat template from an artifact's tokenizer_config.json, rendered the way transformers does.

transformers renders `chat_template` with a sandboxed Jinja2 environment (trim_blocks,
lstrip_blocks), passing `messages`, `add_generation_prompt` and the special tokens by name. The
rendered text already holds the BOS token, so it is tokenized without adding special tokens.
"""
from __future__ import annotations

import json
from pathlib import Path

from dsquant.errors import DsquantError


def _token(value) -> str:
    """A special token as a string (older configs store {"content": ...} dicts)."""
    if isinstance(value, dict):
        return value.get("content", "")
    return value or ""


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = ""):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise DsquantError(f"chat template{origin}: {message}")

        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplate | None:
        """The template of `path`/tokenizer_config.json (or chat_template.jinja), or None."""
        path = Path(path)
        config_file = path / "tokenizer_config.json"
        try:
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DsquantError(f"{config_file}: not valid JSON ({e})") from e
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        if source is None and (path / "chat_template.jinja").is_file():
            source = (path / "chat_template.jinja").read_text()
        if not source:
            return None
        return cls(source, _token(config.get("bos_token")), _token(config.get("eos_token")), f" in {config_file}")

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token)
