"""The server's state, one `AppState` per app at `app.state.server`, and the checks every route makes.

Routes (routes.py, routes_extra.py) are module-level functions that read it from
`request.app.state.server` (`app_state(request)`): the engine loop, the tokenizer and prompt
encoder, the model name and the limits. `dsquant serve --tokenizer` replaces `tokenizer` and
`prompts` before serving (cli_serve.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request
from pydantic import ValidationError

from dsquant.data.tokenizer import backend_tokenizer
from dsquant.runtime.engine.llm_engine import LLMEngine
from dsquant.runtime.server import guards
from dsquant.runtime.server import protocol as P
from dsquant.runtime.server.api_errors import ApiError
from dsquant.runtime.server.chat_template import ChatTemplate
from dsquant.runtime.server.engine_loop import EngineLoop, EngineUnavailable, QueueFull, RequestHandle
from dsquant.runtime.server.metrics import ServerMetrics
from dsquant.runtime.server.prompts import PromptEncoder


@dataclass
class AppState:
    """What the routes share: engine loop, metrics, tokenizer, prompt encoding, limits."""

    engine: LLMEngine
    model_name: str
    api_key: str | None
    max_request_bytes: int
    metrics: ServerMetrics
    loop: EngineLoop
    tokenizer: object | None  # tokenizers.Tokenizer; None without tokenizer.json (prompts as token ids)
    prompts: PromptEncoder
    max_model_len: int
    block_size: int
    num_blocks: int  # KV-cache blocks
    vocab_size: int
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def create(cls, engine: LLMEngine, model_name: str, api_key: str | None, max_queue: int,
               max_request_bytes: int, metrics_prefix: str = "dsquant") -> "AppState":
        api_key = guards.check_api_key(api_key)  # an empty key fails before anything starts
        metrics = ServerMetrics(model_name, metrics_prefix, engine)
        tokenizer = backend_tokenizer(engine.path)  # its own instance: the engine thread decodes with its
        return cls(engine=engine, model_name=model_name, api_key=api_key, max_request_bytes=max_request_bytes,
                   metrics=metrics, loop=EngineLoop(engine, metrics, max_queue), tokenizer=tokenizer,
                   prompts=PromptEncoder(tokenizer, ChatTemplate.from_dir(engine.path), engine.max_model_len,
                                         engine.path),
                   max_model_len=engine.max_model_len, block_size=engine.config.block_size,
                   num_blocks=engine.block_manager.num_blocks, vocab_size=engine.model.config.vocab_size)

    def check_auth(self, request: Request) -> None:
        if self.api_key is not None and not guards.authorized(request.headers.get("authorization", ""),
                                                              self.api_key):
            raise ApiError(401, "missing or wrong API key: send `Authorization: Bearer <key>`")

    async def parse(self, request: Request, model_cls):
        self.check_auth(request)
        guards.require_json(request.headers.get("content-type"))
        body = await guards.read_body(request, self.max_request_bytes)
        try:  # ~10 ms for a 4 MiB body; pydantic holds the GIL, so a thread would not free the loop
            req = P.parse_request(body, model_cls)
        except ValidationError as e:
            raise ApiError(400, *P.describe(e)) from None
        if req.model is not None and req.model != self.model_name:
            raise ApiError(404, f"the model `{req.model}` does not exist; this server serves `{self.model_name}`",
                           "model")
        return req

    def check_lengths(self, ids: list[int], max_tokens: int | None, param: str) -> int:
        """The request's max_tokens after checking the prompt and its output fit max_model_len."""
        n, limit = len(ids), self.max_model_len
        if n == 0:
            raise ApiError(400, "the prompt is empty", "prompt")
        if n >= limit:
            raise ApiError(400, f"the prompt has {n} tokens; this model's max_model_len is {limit}", "prompt")
        max_tokens = limit - n if max_tokens is None else max_tokens
        if n + max_tokens > limit:
            raise ApiError(400, f"the prompt has {n} tokens and {param} is {max_tokens}: {n + max_tokens} "
                           f"tokens exceed this model's max_model_len {limit}", param)
        if -(-(n + max_tokens) // self.block_size) > self.num_blocks:
            raise ApiError(400, f"{n + max_tokens} tokens need more KV blocks than the cache's {self.num_blocks}",
                           param)
        return max_tokens

    def submit(self, ids, params, request_id, arrival) -> RequestHandle:
        try:
            return self.loop.submit(ids, params, request_id, arrival)
        except QueueFull as e:
            raise ApiError(429, f"the server is at capacity ({e}); retry later", headers={"Retry-After": "1"}) from None
        except EngineUnavailable as e:
            raise ApiError(503, str(e)) from None


def app_state(request: Request) -> AppState:
    """The AppState of the app serving `request`."""
    return request.app.state.server
