"""OpenAI request and response bodies (the subset dsquant serves), validated with pydantic.

Requests are strict: a string where a number belongs is a 400, not a silent coercion, and every
sampling field is range-checked here (seed within int64, temperature in [0, 2] as in OpenAI's API,
finite floats only: NaN, Infinity and overflowing literals are refused), so nothing the engine
cannot take reaches it. Bodies are parsed by pydantic's JSON parser (`parse_request`), which
bounds nesting depth and refuses lone surrogates, so a hostile body is a 400 too. Fields
the OpenAI API defines but dsquant does not implement (tools, ...) are ignored, as vLLM does;
/v1/completions implements `echo` and `logprobs`, chat `logprobs` / `top_logprobs` (logprobs.py).
`ignore_eos`, `top_k`, `repetition_penalty` and `add_special_tokens` are vLLM extensions.

vLLM's behaviour, followed here: /v1/completions takes one prompt or a list of them (strings or
token-id lists); `n` completions per prompt come back as choices indexed prompt_i * n + j.
`add_special_tokens` defaults to true for completions (a string prompt gets the tokenizer's BOS;
dsquant adds none when the text already starts with the BOS token's text, so a prompt decoded
from ids that held BOS, as lm-eval's `tokenized_requests=False` sends, is not given two) and to
false for chat (the chat template writes BOS itself). presence/frequency_penalty are in [-2, 2],
repetition_penalty > 0, logit_bias values in [-100, 100] keyed by token id.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dsquant.runtime.engine.sequence import SamplingParams
from dsquant.runtime.server.responses import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                              ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatResponseMessage,
                                              ChatTokenLogprob, ChatTopLogprob, CompletionChoice, CompletionLogprobs,
                                              CompletionResponse, Usage)

__all__ = [  # the request bodies and their parsing, defined here; the response bodies, from responses.py
    "StreamOptions", "CompletionRequest", "ContentPart", "ChatMessage", "ChatCompletionRequest",
    "parse_request", "describe", "error_body", "INT64_MIN", "INT64_MAX", "MAX_TEMPERATURE", "MAX_TOP_K",
    "MAX_N", "MAX_PROMPTS", "MAX_PENALTY", "MAX_BIAS", "MAX_LOGPROBS",
    "ChatChoice", "ChatChunkChoice", "ChatCompletionChunk", "ChatCompletionResponse", "ChatDelta", "ChatLogprobs",
    "ChatResponseMessage", "ChatTokenLogprob", "ChatTopLogprob", "CompletionChoice", "CompletionLogprobs",
    "CompletionResponse", "Usage"]


_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1  # torch.Generator.manual_seed's range
MAX_TEMPERATURE = 2.0  # OpenAI's API
MAX_TOP_K = 2 ** 31 - 1  # the sampler's int32
MAX_N = 128  # completions per prompt
MAX_PROMPTS = 256  # prompts per /v1/completions request
MAX_PENALTY, MAX_BIAS = 2.0, 100.0  # OpenAI's ranges for presence/frequency_penalty and logit_bias


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v, info):
        if not -MAX_PENALTY <= v <= MAX_PENALTY:
            raise ValueError(f"{info.field_name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v}")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition(cls, v):
        if not 0 < v <= 1e6:
            raise ValueError(f"repetition_penalty must be > 0 (1: off), got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 12):
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias}")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v):
        if v is not None and v <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {v}")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        if not 0 <= v <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {v}")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):
        if v is not None and not INT64_MIN <= v <= INT64_MAX:
            raise ValueError(f"seed must be a 64-bit signed integer, in [{INT64_MIN}, {INT64_MAX}], got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if not -1 <= v <= MAX_TOP_K:
            raise ValueError(f"top_k must be -1 or 0 (off) or in [1, {MAX_TOP_K}], got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v):
        if not 0 < v <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {v}")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if not 1 <= v <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {v}")
        return v

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias = {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, logit_bias=bias)


MAX_LOGPROBS = 20


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt or a batch of them
    max_tokens: int | None = 16  # the OpenAI default for completions; 0 only with echo
    echo: bool = False
    logprobs: int | None = None
    add_special_tokens: bool = True  # vLLM's default for completions: a string prompt gets BOS

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v):
        if v is not None and v < 0:
            raise ValueError(f"max_tokens must be at least 0 (0 only with echo), got {v}")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {v}")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        batch = v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]
        if len(batch) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(batch)}")
        for i, one in enumerate(batch):
            if not one:
                raise ValueError("the prompt is empty" if len(batch) == 1 else f"prompt {i} is empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: each a string or a list of token ids."""
        v = self.prompt
        return list(v) if isinstance(v, list) and isinstance(v[0], (str, list)) else [v]

    @model_validator(mode="after")
    def _no_stream_with_logprobs(self):  # max_tokens 0 without echo: the route says so, naming the param
        if self.stream and (self.echo or self.logprobs is not None):
            raise ValueError("echo and logprobs are not supported with stream: true")
        return self

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        params = super().sampling_params(max(1, max_tokens))  # max_tokens 0: one token, left out of the reply
        params.logprobs = self.logprobs
        params.prompt_logprobs = self.logprobs if self.echo else None
        return params


class ContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    add_special_tokens: bool = False  # vLLM's default for chat: the template writes BOS itself

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v, info):
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {v}")
        if v and not info.data.get("logprobs"):  # logprobs is declared first, so it is in info.data
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        params = super().sampling_params(max_tokens)
        params.logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return params

    @field_validator("max_completion_tokens")
    @classmethod
    def _positive_completion(cls, v):
        if v is not None and v <= 0:
            raise ValueError(f"max_completion_tokens must be at least 1, got {v}")
        return v


def parse_request(body: bytes, model_cls: type[BaseModel]) -> BaseModel:
    """Parse and validate a request body in one pass; raises ValidationError (see `describe`)."""
    return model_cls.model_validate_json(body)


def describe(err: ValidationError) -> tuple[str, str | None]:
    """The first validation error as (message, param) for an OpenAI error body."""
    first = err.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return f"the request body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}", None
    if first["type"] == "model_type" and not first["loc"]:
        return "the request body must be a JSON object", None
    param = ".".join(str(x) for x in first["loc"]) or None
    msg = first["msg"].removeprefix("Value error, ")
    return (f"{param}: {msg}" if param and not msg.startswith(param) else msg), param


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


