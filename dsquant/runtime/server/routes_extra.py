"""vLLM's extra routes: GET /v1/models/{id}, POST /tokenize and /detokenize, GET /version.

POST /tokenize takes {prompt, add_special_tokens (default true)} or {messages,
add_generation_prompt (default true), add_special_tokens (default false)}, as the completion and
chat routes would tokenize them, and answers {count, max_model_len, tokens} (plus token_strs
with return_token_strs: true). POST /detokenize takes {tokens} and answers {prompt}. GET
/version answers {version}: dsquant's. An unknown model id is a 404 in OpenAI's error shape.
Module-level functions on `router`, over the app's AppState (state.py), as routes.py.
"""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, model_validator

from dsquant import __version__
from dsquant.runtime.server import protocol as P
from dsquant.runtime.server.api_errors import ApiError
from dsquant.runtime.server.logprobs import token_string
from dsquant.runtime.server.state import app_state

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = P._STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[P.ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (as vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of `prompt` and `messages`")
        return self


class DetokenizeRequest(BaseModel):
    model_config = P._STRICT
    model: str | None = None
    tokens: list[int]


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    s = app_state(request)
    s.check_auth(request)
    if model_id != s.model_name:
        raise ApiError(404, f"the model `{model_id}` does not exist; this server serves `{s.model_name}`", "model")
    return {"id": s.model_name, "object": "model", "created": s.created, "owned_by": "dsquant",
            "max_model_len": s.max_model_len}


@router.post("/tokenize")
async def tokenize(request: Request):
    s = app_state(request)
    req = await s.parse(request, TokenizeRequest)
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await asyncio.to_thread(s.prompts.encode, req.prompt, special)
    else:
        messages = [{"role": m.role, "content": m.text} for m in req.messages]
        ids = await asyncio.to_thread(s.prompts.chat_ids, messages, bool(req.add_special_tokens),
                                      req.add_generation_prompt)
    body = {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = [token_string(s.tokenizer, t) for t in ids]
    return body


@router.post("/detokenize")
async def detokenize(request: Request):
    s = app_state(request)
    req = await s.parse(request, DetokenizeRequest)
    if s.tokenizer is None:
        raise ApiError(400, f"{s.engine.path} has no tokenizer.json")
    if any(not 0 <= t < s.vocab_size for t in req.tokens):
        raise ApiError(400, f"token ids must be in [0, {s.vocab_size})", "tokens")
    text = await asyncio.to_thread(s.tokenizer.decode, req.tokens, skip_special_tokens=False)
    return {"prompt": text}


@router.get("/version")
async def version():
    return {"version": __version__}
