"""The OpenAI routes: POST /v1/completions and /v1/chat/completions, GET /v1/models, /health, /metrics.

Module-level functions on `router`, each reading the app's AppState from the request (state.py).
The completion routes tokenize and check the prompts here; serving.py submits them and answers.
"""
from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from dsquant.runtime.server import protocol as P
from dsquant.runtime.server import serving
from dsquant.runtime.server.api_errors import ApiError
from dsquant.runtime.server.metrics import CONTENT_TYPE
from dsquant.runtime.server.state import app_state

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    return Response(status_code=200 if app_state(request).loop.alive else 503)


@router.get("/metrics")
async def metrics(request: Request):
    return Response(app_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models")
async def models(request: Request):
    s = app_state(request)
    s.check_auth(request)
    return {"object": "list", "data": [{"id": s.model_name, "object": "model", "created": s.created,
                                        "owned_by": "dsquant", "max_model_len": s.max_model_len}]}


@router.post("/v1/completions")
async def completions(request: Request):
    arrival = time.monotonic()
    s = app_state(request)
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


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    arrival = time.monotonic()
    s = app_state(request)
    req = await s.parse(request, P.ChatCompletionRequest)
    serving.check_logit_bias(req, s.vocab_size)
    ids = await asyncio.to_thread(s.prompts.chat_ids, [{"role": m.role, "content": m.text} for m in req.messages],
                                  req.add_special_tokens)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = s.check_lengths(ids, req.max_completion_tokens or req.max_tokens, param)
    return await serving.respond(s, request, req, [serving.Prompt(ids, max_tokens)],
                                 f"chatcmpl-{uuid.uuid4().hex}", arrival, chat=True)
