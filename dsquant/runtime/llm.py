"""Offline generation API: `dsquant.LLM(path).generate(prompts, params)`."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dsquant.assets import resolve_model_dir
from dsquant.runtime.engine.llm_engine import EngineConfig, LLMEngine
from dsquant.runtime.engine.sequence import SamplingParams


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int = 0


class LLM:
    """Loads a checkpoint or artifact once; generate() runs prompts to completion in one batch."""

    def __init__(self, path: str | Path, config: EngineConfig | None = None, **overrides):
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            raise TypeError("pass either config or keyword overrides, not both")
        self.engine = LLMEngine(resolve_model_dir(str(path)), config)

    def close(self) -> None:
        """Stop tensor-parallel workers (if any); also runs at interpreter exit."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[CompletionOutput]:
        """prompts: a string, a list of token ids, or a list of either; one output per prompt, in order."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"{len(plist)} sampling params for {len(batch)} prompts")
        order = [self.engine.add_request(p, sp) for p, sp in zip(batch, plist)]
        done: dict[str, CompletionOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = CompletionOutput(out.request_id, out.prompt_token_ids, out.token_ids,
                                                            out.text, out.finish_reason, out.num_cached_tokens)
        return [done[r] for r in order]
