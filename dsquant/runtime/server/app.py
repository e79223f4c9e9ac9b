"""The OpenAI-compatible FastAPI app over one LLMEngine: `create_app(engine, model_name=...)`.

Routes: POST /v1/completions and /v1/chat/completions (stream: true sends server-sent events
ending with `data: [DONE]`; serving.py runs them), GET /v1/models, /health and /metrics, and
vLLM's GET /v1/models/{id}, POST /tokenize, /detokenize, GET /version (routes_extra.py); all are
module-level functions on APIRouters (routes.py, routes_extra.py) over the app's AppState at
`app.state.server` (state.py). Errors use OpenAI's body, {"error": {"message", "type", "param",
"code"}}. Every completion request logs one line on the `dsquant.server` logger: id, status,
tokens in/out, time to first token, total time (serving.ResponseLog).
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsquant.runtime.engine.llm_engine import LLMEngine
from dsquant.runtime.server import guards, routes, routes_extra
from dsquant.runtime.server.api_errors import ApiError
from dsquant.runtime.server.api_errors import error_response as _error_response
from dsquant.runtime.server.state import AppState

log = logging.getLogger("dsquant.server")

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB: a max_model_len prompt of token ids or text fits


@asynccontextmanager
async def lifespan(app: FastAPI):
    """The engine loop runs from the app's startup to its shutdown."""
    s: AppState = app.state.server
    s.loop.start(asyncio.get_running_loop())
    yield
    await asyncio.to_thread(s.loop.stop)


async def _api_error(request: Request, e: ApiError):
    if request.url.path.startswith("/v1/") and request.method == "POST":
        log.info("- %d %s %s", e.status, request.url.path, e.message)
    return _error_response(e.status, e.message, e.param, e.headers)


async def _http_error(request: Request, e: StarletteHTTPException):
    return _error_response(e.status_code, str(e.detail))


async def _validation_error(request: Request, e: RequestValidationError):
    return _error_response(400, str(e.errors()[0].get("msg", e)))


async def _bug(request: Request, e: Exception):  # Starlette still logs the traceback
    return _error_response(500, f"internal server error: {type(e).__name__}")


def create_app(engine: LLMEngine, model_name: str | None = None, api_key: str | None = None,
               max_queue: int = 256, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               allowed_hosts: list[str] | None = None, allowed_origins: list[str] | None = None,
               metrics_prefix: str = "dsquant") -> FastAPI:
    """The app. allowed_hosts: Host names it answers ("*.example.com" patterns, "*" for any;
    default: the loopback names). allowed_origins: origins granted CORS (default: none, and no
    CORS headers at all). metrics_prefix: "dsquant" or "vllm", the prefix of /metrics' names.
    An empty api_key is refused (DsquantError)."""
    s = AppState.create(engine, model_name or engine.path.name, api_key, max_queue, max_request_bytes,
                        metrics_prefix)
    app = FastAPI(title="dsquant", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server, app.state.engine_loop, app.state.metrics = s, s.loop, s.metrics
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"], max_age=600)
    app.add_middleware(guards.HostGuard, allowed_hosts=list(allowed_hosts or guards.LOOPBACK_NAMES))  # outermost
    for exc, handler in ((ApiError, _api_error), (StarletteHTTPException, _http_error),
                         (RequestValidationError, _validation_error), (Exception, _bug)):
        app.add_exception_handler(exc, handler)
    app.include_router(routes.router)
    app.include_router(routes_extra.router)  # /v1/models/{id}, /tokenize, /detokenize, /version
    return app
