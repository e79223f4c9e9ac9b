"""Running a completion or chat request: one engine request per (prompt, sample), one response.

A request with P prompts (completions take a list) and `n` samples each becomes P * n engine
requests; their choices are indexed as OpenAI does, index = prompt_i * n + j. With a seed, sample
j uses seed + j (as vLLM), so the n samples differ yet reproduce. Usage counts each prompt's
tokens once and every choice's completion tokens. Non-streaming, the response waits for all
choices (all are aborted if the client leaves first); streaming, the choices' chunks interleave
as the engine produces them, each carrying its index, then the usage chunk (when asked for) and
`data: [DONE]`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from dsquant.runtime.server import protocol as P
from dsquant.runtime.server.api_errors import ERROR_TYPES, ApiError
from dsquant.runtime.server.engine_loop import EngineUnavailable, RequestFailed, RequestHandle, RequestRejected
from dsquant.runtime.server.logprobs import chat_logprobs, completion_choice

if TYPE_CHECKING:
    from dsquant.runtime.server.state import AppState

log = logging.getLogger("dsquant.server")

FAILURES = {RequestRejected: 400, RequestFailed: 500, EngineUnavailable: 503}
_SEED_SPAN = 2 ** 64


@dataclass
class Prompt:
    ids: list[int]  # the prompt's token ids
    max_tokens: int  # after the length checks
    source: str | list[int] | None = None  # as the request sent it (completions' echo)


@dataclass
class ResponseLog:
    """One response's log line (`dsquant.server`, info): id, status, tokens in and out, TTFT, total time.

    Filled in as the response goes: `first` gets the monotonic time of the first output (collect and
    the stream append it), a stream sets `status` and `n_out` as it runs.
    """

    rid: str
    arrival: float  # time.monotonic() when the request came
    n_in: int  # prompt tokens
    first: list[float] = field(default_factory=list)
    status: int = 499  # 499: the client left before the end
    n_out: int = 0

    def write(self, status: int | None = None, n_out: int | None = None) -> None:
        status = self.status if status is None else status
        n_out = self.n_out if n_out is None else n_out
        ttft = f"{self.first[0] - self.arrival:.3f}s" if self.first else "-"
        log.info("%s %d tokens in %d out %d ttft %s total %.3fs", self.rid, status, self.n_in, n_out, ttft,
                 time.monotonic() - self.arrival)


def check_logit_bias(req, vocab_size: int) -> None:
    for key in req.logit_bias or {}:
        if int(key) >= vocab_size:
            raise ApiError(400, f"logit_bias: token id {key} is out of range: the vocabulary has {vocab_size} "
                           "tokens", "logit_bias")


def _seed(seed: int, j: int) -> int:
    """seed + j wrapped into int64."""
    return (seed + j + 2 ** 63) % _SEED_SPAN - 2 ** 63


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(request: Request, handles: list[RequestHandle], first: list[float]):
    """The final outputs of non-streaming requests, in order; None when the client went away first.
    `first` gets the monotonic time of the first output."""
    async def consume(handle):
        last = None
        async for out in handle.outputs():
            if not first:
                first.append(time.monotonic())
            last = out
        return last

    async def consume_all():  # a Task (not the gather future itself), so cancelling it reads as cancelled
        return await asyncio.gather(*(consume(h) for h in handles))

    task = asyncio.ensure_future(consume_all())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # a cancelled task is done only once it has run its cancellation
    return None if task.cancelled() else task.result()


async def merged(handles: list[RequestHandle]):
    """(choice index, RequestOutput) of all handles as they come; raises the first failure."""
    if len(handles) == 1:
        async for out in handles[0].outputs():
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, handle: RequestHandle) -> None:
        try:
            async for out in handle.outputs():
                q.put_nowait((k, out, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            q.put_nowait((k, None, e))
            return
        q.put_nowait((k, None, None))

    tasks = [asyncio.ensure_future(pump(k, h)) for k, h in enumerate(handles)]
    try:
        left = len(handles)
        while left:
            k, out, err = await q.get()
            if err is not None:
                raise err
            if out is None:
                left -= 1
                continue
            yield k, out
    finally:
        for t in tasks:
            t.cancel()


def sse(payload) -> str:
    body = payload if isinstance(payload, str) else payload.model_dump_json(exclude_none=True)
    return f"data: {body}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose `on_close` runs however the response ends.

    When the client disconnects, Starlette cancels the response, possibly before the body
    generator has started (so its own `finally` would never run); `on_close` aborts the
    requests and writes the log line in every case.
    """

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def respond(s: AppState, request: Request, req, prompts: list[Prompt], rid: str, arrival: float, chat: bool):
    """Submit the request's P * n engine requests and answer (JSON, or an event stream)."""
    n = req.n
    handles: list[RequestHandle] = []
    try:
        for i, p in enumerate(prompts):
            for j in range(n):
                params = req.sampling_params(p.max_tokens)
                if params.seed is not None and j:
                    params.seed = _seed(params.seed, j)
                sub = rid if len(prompts) * n == 1 else f"{rid}-{i * n + j}"
                handles.append(s.submit(p.ids, params, sub, arrival))
    except BaseException:
        for h in handles:
            h.close()
        raise
    n_in = sum(len(p.ids) for p in prompts)
    record = ResponseLog(rid, arrival, n_in)

    def close_all() -> None:
        for h in handles:
            h.close()

    if req.stream:
        def on_close() -> None:  # however the stream ended: abort if unfinished, then log
            close_all()
            record.write()

        return EventStream(_stream(s, req, handles, record, chat), on_close)
    try:
        finals = await collect(request, handles, record.first)
    except (RequestRejected, RequestFailed, EngineUnavailable) as e:
        status = FAILURES[type(e)]
        record.write(status, 0)
        raise ApiError(status, str(e)) from None
    finally:
        close_all()
    if finals is None:  # the client disconnected; the requests were aborted
        record.write(499, 0)
        return Response(status_code=499)
    if chat:
        choices = [P.ChatChoice(index=k, message=P.ChatResponseMessage(content=f.text), finish_reason=f.finish_reason,
                                logprobs=chat_logprobs(f.token_ids, f.logprobs or [], req.top_logprobs or 0,
                                                       s.tokenizer) if req.logprobs else None)
                   for k, f in enumerate(finals)]
        n_out = sum(len(f.token_ids) for f in finals)
        record.write(200, n_out)
        return P.ChatCompletionResponse(id=rid, model=s.model_name, usage=P.Usage.of(n_in, n_out), choices=choices)
    choices, n_out = [], 0
    for k, f in enumerate(finals):
        p = prompts[k // n]
        choice, kept = completion_choice(req, p.ids, f, s.tokenizer, p.source, k)  # echo, logprobs, max_tokens 0
        choices.append(choice)
        n_out += kept
    record.write(200, n_out)
    return P.CompletionResponse(id=rid, model=s.model_name, usage=P.Usage.of(n_in, n_out), choices=choices)


async def _stream(s: AppState, req, handles, record: ResponseLog, chat: bool):
    rid = record.rid
    created = int(time.time())
    counts = [0] * len(handles)  # per choice: tokens so far (and logprobs sent, for chat)
    if chat:
        def chunk(k=0, text=None, finish=None, role=None, usage=None, logprobs=None, choices=True):
            c = [P.ChatChunkChoice(index=k, delta=P.ChatDelta(role=role, content=text), finish_reason=finish,
                                   logprobs=logprobs)]
            return P.ChatCompletionChunk(id=rid, created=created, model=s.model_name,
                                         choices=c if choices else [], usage=usage)
    else:
        def chunk(k=0, text=None, finish=None, role=None, usage=None, logprobs=None, choices=True):
            c = [P.CompletionChoice(index=k, text=text or "", finish_reason=finish)]
            return P.CompletionResponse(id=rid, created=created, model=s.model_name,
                                        choices=c if choices else [], usage=usage)
    want_logprobs = chat and req.logprobs
    try:
        if chat:
            for k in range(len(handles)):
                yield sse(chunk(k, text="", role="assistant"))
        async for k, out in merged(handles):
            if not record.first:
                record.first.append(time.monotonic())
            done = counts[k]
            counts[k] = len(out.token_ids)
            record.n_out = sum(counts)
            lp = None
            if want_logprobs and counts[k] > done:
                lp = chat_logprobs(out.token_ids[done:], (out.logprobs or [])[done:], req.top_logprobs or 0,
                                   s.tokenizer)
            if out.delta_text or out.finished or lp is not None:
                yield sse(chunk(k, text=out.delta_text, finish=out.finish_reason, logprobs=lp))
        if req.include_usage:
            yield sse(chunk(usage=P.Usage.of(record.n_in, record.n_out), choices=False))
        yield sse("[DONE]")
        record.status = 200
    except (RequestRejected, RequestFailed, EngineUnavailable) as e:
        record.status = status = FAILURES[type(e)]
        yield sse(json.dumps(P.error_body(str(e), ERROR_TYPES[status], status)))
        yield sse("[DONE]")
