"""The OpenAI-compatible FastAPI app over one LLMEngine: `create_app(engine, model_name=...)`.

Routes: POST /v1/completions and /v1/chat/completions (stream: true sends server-sent events
ending with `data: [DONE]`; serving.py runs them), GET /v1/models, /health and /metrics, and
vLLM's GET /v1/models/{id}, POST /tokenize, /detokenize, GET /version (routes_extra.py). Errors use OpenAI's body,
{"error": {"message", "type", "param", "code"}}. Every completion request logs one line on the
`dsquant.server` logger: id, status, tokens in/out, time to first token, total time.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsquant.data.tokenizer import backend_tokenizer
from dsquant.runtime.engine.llm_engine import LLMEngine
from dsquant.runtime.server import guards, routes_extra, serving
from dsquant.runtime.server import protocol as P
from dsquant.runtime.server.api_errors import ApiError
from dsquant.runtime.server.api_errors import error_response as _error_response
from dsquant.runtime.server.chat_template import ChatTemplate
from dsquant.runtime.server.engine_loop import EngineLoop, EngineUnavailable, QueueFull, RequestHandle
from dsquant.runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from dsquant.runtime.server.prompts import PromptEncoder

log = logging.getLogger("dsquant.server")

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB: a max_model_len prompt of token ids or text fits


class _Server:
    """Request handling state shared by the routes: engine loop, tokenizer, template, limits."""

    def __init__(self, engine: LLMEngine, model_name: str, api_key: str | None, max_queue: int,
                 max_request_bytes: int, metrics_prefix: str = "dsquant"):
        self.engine, self.model_name, self.api_key = engine, model_name, guards.check_api_key(api_key)
        self.max_request_bytes = max_request_bytes
        self.metrics = ServerMetrics(model_name, metrics_prefix, engine)
        self.loop = EngineLoop(engine, self.metrics, max_queue)
        self.tokenizer = backend_tokenizer(engine.path)  # its own instance: the engine thread decodes with its
        self.max_model_len = engine.max_model_len
        self.prompts = PromptEncoder(self.tokenizer, ChatTemplate.from_dir(engine.path), self.max_model_len,
                                     engine.path)
        self.block_size, self.num_blocks = engine.config.block_size, engine.block_manager.num_blocks
        self.vocab_size = engine.model.config.vocab_size
        self.created = int(time.time())

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


def create_app(engine: LLMEngine, model_name: str | None = None, api_key: str | None = None,
               max_queue: int = 256, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               allowed_hosts: list[str] | None = None, allowed_origins: list[str] | None = None,
               metrics_prefix: str = "dsquant") -> FastAPI:
    """The app. allowed_hosts: Host names it answers ("*.example.com" patterns, "*" for any;
    default: the loopback names). allowed_origins: origins granted CORS (default: none, and no
    CORS headers at all). metrics_prefix: "dsquant" or "vllm", the prefix of /metrics' names.
    An empty api_key is refused (DsquantError)."""
    s = _Server(engine, model_name or engine.path.name, api_key, max_queue, max_request_bytes, metrics_prefix)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        s.loop.start(asyncio.get_running_loop())
        yield
        await asyncio.to_thread(s.loop.stop)

    app = FastAPI(title="dsquant", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server, app.state.engine_loop, app.state.metrics = s, s.loop, s.metrics
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"], max_age=600)
    app.add_middleware(guards.HostGuard, allowed_hosts=list(allowed_hosts or guards.LOOPBACK_NAMES))  # outermost

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        if request.url.path.startswith("/v1/") and request.method == "POST":
            log.info("- %d %s %s", e.status, request.url.path, e.message)
        return _error_response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return _error_response(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return _error_response(400, str(e.errors()[0].get("msg", e)))

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):  # Starlette still logs the traceback
        return _error_response(500, f"internal server error: {type(e).__name__}")

    @app.get("/health")
    async def health():
        return Response(status_code=200 if s.loop.alive else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(s.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        s.check_auth(request)
        return {"object": "list", "data": [{"id": s.model_name, "object": "model", "created": s.created,
                                            "owned_by": "dsquant", "max_model_len": s.max_model_len}]}

    routes_extra.register(app, s)  # /v1/models/{id}, /tokenize, /detokenize, /version

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.monotonic()
        req = await s.parse(request, P.CompletionRequest)
        if req.max_tokens == 0 and not req.echo:
            raise ApiError(400, "max_tokens must be at least 1 (0 only with echo: true, to score the prompt)",
                           "max_tokens")
        serving.check_logit_bias(req, s.vocab_size)
        prompts = []
        for prompt in req.prompts:
            if isinstance(prompt, str):
                ids = await asyncio.to_thread(s.prompts.encode, prompt, req.add_special_tokens)
            else:
                ids = list(prompt)
            max_tokens = s.check_lengths(ids, req.max_tokens, "max_tokens")
            if any(not 0 <= t < s.vocab_size for t in ids):
                raise ApiError(400, f"prompt token ids must be in [0, {s.vocab_size})", "prompt")
            prompts.append(serving.Prompt(ids, max_tokens, prompt))
        return await serving.respond(s, request, req, prompts, f"cmpl-{uuid.uuid4().hex}", arrival, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        req = await s.parse(request, P.ChatCompletionRequest)
        serving.check_logit_bias(req, s.vocab_size)
        ids = await asyncio.to_thread(s.prompts.chat_ids, [{"role": m.role, "content": m.text} for m in req.messages],
                                      req.add_special_tokens)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = s.check_lengths(ids, req.max_completion_tokens or req.max_tokens, param)
        return await serving.respond(s, request, req, [serving.Prompt(ids, max_tokens)],
                                     f"chatcmpl-{uuid.uuid4().hex}", arrival, chat=True)

    return app
