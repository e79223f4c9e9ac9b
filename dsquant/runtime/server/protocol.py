"""OpenAI request and response bodies (the subset dsquant serves), validated with pydantic.

Requests are strict: a string where a number belongs is a 400, not a silent coercion, and every
sampling field is range-checked here (seed within int64, temperature in [0, 2] as in OpenAI's API,
finite floats only: NaN, Infinity and overflowing literals are refused), so nothing the engine
cannot take reaches it. Bodies are parsed by pydantic's JSON parser (`parse_request`), which
bounds nesting depth and refuses lone surrogates, so a hostile body is a 400 too. Fields
the OpenAI API defines but dsquant does not implement (chat logprobs, tools, ...) are ignored, as
vLLM does; /v1/completions implements `echo` and `logprobs` (see logprobs.py). `ignore_eos` and `top_k` are vLLM extensions that benchmarks rely on.
"""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dsquant.runtime.engine.sequence import SamplingParams


_STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1  # torch.Generator.manual_seed's range
MAX_TEMPERATURE = 2.0  # OpenAI's API
MAX_TOP_K = 2 ** 31 - 1  # the sampler's int32


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
        if v != 1:
            raise ValueError(f"only n = 1 is supported, got {v}")
        return v

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos)


MAX_LOGPROBS = 20


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]  # a one-element batch is unwrapped
    max_tokens: int | None = 16  # the OpenAI default for completions; 0 only with echo
    echo: bool = False
    logprobs: int | None = None

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
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"one prompt per request is supported, got {len(v)}")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v

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


# ---------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
