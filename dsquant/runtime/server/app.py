"""The OpenAI-compatible FastAPI app over one LLMEngine: `create_app(engine, model_name=...)`.

Routes: POST /v1/completions and /v1/chat/completions (stream: true sends server-sent events
ending with `data: [DONE]`), GET /v1/models, /health and /metrics. Errors use OpenAI's body,
{"error": {"message", "type", "param", "code"}}. Every completion request logs one line on the
`dsquant.server` logger: id, status, tokens in/out, time to first token, total time.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsquant.runtime.engine.llm_engine import LLMEngine, load_tokenizer
from dsquant.runtime.server import guards
from dsquant.runtime.server import protocol as P
from dsquant.runtime.server.api_errors import ERROR_TYPES as _ERROR_TYPES
from dsquant.runtime.server.api_errors import ApiError
from dsquant.runtime.server.api_errors import error_response as _error_response
from dsquant.runtime.server.chat_template import ChatTemplate
from dsquant.runtime.server.engine_loop import (EngineLoop, EngineUnavailable, QueueFull, RequestFailed,
                                                RequestHandle, RequestRejected)
from dsquant.runtime.server.logprobs import completion_choice
from dsquant.runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from dsquant.runtime.server.prompts import PromptEncoder

log = logging.getLogger("dsquant.server")

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB: a max_model_len prompt of token ids or text fits
_FAILURES = {RequestRejected: 400, RequestFailed: 500, EngineUnavailable: 503}


class _Server:
    """Request handling state shared by the routes: engine loop, tokenizer, template, limits."""

    def __init__(self, engine: LLMEngine, model_name: str, api_key: str | None, max_queue: int,
                 max_request_bytes: int):
        self.engine, self.model_name, self.api_key = engine, model_name, guards.check_api_key(api_key)
        self.max_request_bytes = max_request_bytes
        self.metrics = ServerMetrics(model_name)
        self.loop = EngineLoop(engine, self.metrics, max_queue)
        self.tokenizer = load_tokenizer(engine.path)  # its own instance: the engine thread decodes with its
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


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, handle: RequestHandle, first: list[float]):
    """The final output of a non-streaming request; None when the client went away first."""
    async def consume():
        last = None
        async for out in handle.outputs():
            if not first:
                first.append(time.monotonic())
            last = out
        return last

    task, watcher = asyncio.ensure_future(consume()), asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # a cancelled task is done only once it has run its cancellation
    return None if task.cancelled() else task.result()


def _sse(payload) -> str:
    body = payload if isinstance(payload, str) else payload.model_dump_json(exclude_none=True)
    return f"data: {body}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events whose `on_close` runs however the response ends.

    When the client disconnects, Starlette cancels the response, possibly before the body
    generator has started (so its own `finally` would never run); `on_close` aborts the
    request and writes its log line in every case.
    """

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def create_app(engine: LLMEngine, model_name: str | None = None, api_key: str | None = None,
               max_queue: int = 256, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               allowed_hosts: list[str] | None = None, allowed_origins: list[str] | None = None) -> FastAPI:
    """The app. allowed_hosts: Host names it answers ("*.example.com" patterns, "*" for any;
    default: the loopback names). allowed_origins: origins granted CORS (default: none, and no
    CORS headers at all). An empty api_key is refused (DsquantError)."""
    s = _Server(engine, model_name or engine.path.name, api_key, max_queue, max_request_bytes)

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

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.monotonic()
        req = await s.parse(request, P.CompletionRequest)
        if isinstance(req.prompt, str):
            ids = await asyncio.to_thread(s.prompts.encode, req.prompt, True)
        else:
            ids = list(req.prompt)
        if req.max_tokens == 0 and not req.echo:
            raise ApiError(400, "max_tokens must be at least 1 (0 only with echo: true, to score the prompt)",
                           "max_tokens")
        max_tokens = s.check_lengths(ids, req.max_tokens, "max_tokens")
        if any(not 0 <= t < s.vocab_size for t in ids):
            raise ApiError(400, f"prompt token ids must be in [0, {s.vocab_size})", "prompt")
        return await _run(request, req, ids, max_tokens, f"cmpl-{uuid.uuid4().hex}", arrival, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        req = await s.parse(request, P.ChatCompletionRequest)
        ids = await asyncio.to_thread(s.prompts.chat_ids, [{"role": m.role, "content": m.text} for m in req.messages])
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = s.check_lengths(ids, req.max_completion_tokens or req.max_tokens, param)
        return await _run(request, req, ids, max_tokens, f"chatcmpl-{uuid.uuid4().hex}", arrival, chat=True)

    async def _run(request: Request, req, ids: list[int], max_tokens: int, rid: str, arrival: float, chat: bool):
        params = req.sampling_params(max_tokens)
        handle = s.submit(ids, params, rid, arrival)
        first: list[float] = []

        def log_line(status: int, n_out: int) -> None:
            ttft = f"{first[0] - arrival:.3f}s" if first else "-"
            log.info("%s %d tokens in %d out %d ttft %s total %.3fs", rid, status, len(ids), n_out, ttft,
                     time.monotonic() - arrival)

        if req.stream:
            state = {"status": 499, "n_out": 0}  # 499: the client left before the end

            def on_close() -> None:  # however the stream ended: abort if unfinished, then log
                handle.close()
                log_line(state["status"], state["n_out"])

            return _EventStream(_stream(req, ids, rid, handle, first, state, chat), on_close)
        try:
            final = await _collect(request, handle, first)
        except (RequestRejected, RequestFailed, EngineUnavailable) as e:
            status = _FAILURES[type(e)]
            log_line(status, 0)
            raise ApiError(status, str(e)) from None
        finally:
            handle.close()
        if final is None:  # the client disconnected; the request was aborted
            log_line(499, 0)
            return Response(status_code=499)
        usage = P.Usage.of(len(ids), len(final.token_ids))
        log_line(200, usage.completion_tokens)
        if chat:
            return P.ChatCompletionResponse(id=rid, model=s.model_name, usage=usage, choices=[P.ChatChoice(
                message=P.ChatResponseMessage(content=final.text), finish_reason=final.finish_reason)])
        choice, n_out = completion_choice(req, ids, final, s.tokenizer)  # echo, logprobs, max_tokens 0
        return P.CompletionResponse(id=rid, model=s.model_name, usage=P.Usage.of(len(ids), n_out), choices=[choice])

    async def _stream(req, ids, rid, handle: RequestHandle, first: list[float], state: dict, chat: bool):
        created = int(time.time())
        if chat:
            def chunk(text=None, finish=None, role=None, usage=None, choices=True):
                c = [P.ChatChunkChoice(delta=P.ChatDelta(role=role, content=text), finish_reason=finish)]
                return P.ChatCompletionChunk(id=rid, created=created, model=s.model_name,
                                             choices=c if choices else [], usage=usage)
        else:
            def chunk(text=None, finish=None, role=None, usage=None, choices=True):
                c = [P.CompletionChoice(text=text or "", finish_reason=finish)]
                return P.CompletionResponse(id=rid, created=created, model=s.model_name,
                                            choices=c if choices else [], usage=usage)
        try:
            if chat:
                yield _sse(chunk(text="", role="assistant"))
            async for out in handle.outputs():
                if not first:
                    first.append(time.monotonic())
                state["n_out"] = len(out.token_ids)
                if out.delta_text or out.finished:
                    yield _sse(chunk(text=out.delta_text, finish=out.finish_reason))
            if req.include_usage:
                yield _sse(chunk(usage=P.Usage.of(len(ids), state["n_out"]), choices=False))
            yield _sse("[DONE]")
            state["status"] = 200
        except (RequestRejected, RequestFailed, EngineUnavailable) as e:
            state["status"] = status = _FAILURES[type(e)]
            yield _sse(json.dumps(P.error_body(str(e), _ERROR_TYPES[status], status)))
            yield _sse("[DONE]")

    return app
