"""The engine thread beside the asyncio HTTP loop.

The LLMEngine is not thread-safe, so one thread owns it: it takes commands (add, abort, stop)
from a thread-safe inbox, runs `engine.step()` while anything is unfinished, records metrics,
and hands each step's outputs to the per-request asyncio queues with one
`loop.call_soon_threadsafe` per step. The HTTP loop never waits on a step, so /health and new
connections answer while the engine is busy.

Admission control lives on the HTTP side: at most max_num_seqs running plus max_queue waiting
requests are in flight; one more is refused (429) before it reaches the engine.

No exception from adding or stepping a request kills the loop: a failed add fails that request
(RequestRejected for a DsquantError, RequestFailed otherwise), and a failed step fails the
requests in the engine, aborts them and carries on. Only MAX_STEP_FAILURES failed steps in a row
(the engine is broken, not one request), or an engine left inconsistent by the failure, stop the
loop; /health then answers 503.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from dsquant.errors import DsquantError
from dsquant.runtime.engine.llm_engine import LLMEngine, RequestOutput
from dsquant.runtime.engine.sequence import SamplingParams, SequenceStatus
from dsquant.runtime.server.metrics import ServerMetrics

log = logging.getLogger("dsquant.server")


class QueueFull(Exception):
    """The waiting queue is full: answer 429."""


class EngineUnavailable(Exception):
    """The engine loop has stopped (shutdown or a crash): answer 503."""


class RequestRejected(Exception):
    """The engine refused the request (e.g. more KV blocks than the cache holds): answer 400."""


class RequestFailed(Exception):
    """The engine failed while adding or stepping this request (a server fault): answer 500."""


MAX_STEP_FAILURES = 3  # failed steps in a row that mean the engine itself is broken


@dataclass
class _Tracked:  # the engine thread's view of one request
    queue: asyncio.Queue
    arrival: float
    num_prompt_tokens: int
    max_tokens: int = 0
    scheduled: bool = False
    scheduled_at: float = 0.0
    first_token_time: float | None = None
    last_token_time: float | None = None


class RequestHandle:
    """The HTTP side of one request: `outputs()` yields RequestOutputs; `close()` aborts if unfinished."""

    def __init__(self, owner: EngineLoop, request_id: str, q: asyncio.Queue):
        self.owner, self.request_id, self.queue = owner, request_id, q
        self.finished = False
        self._closed = False

    async def outputs(self):
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, Exception):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self.owner.abort(self.request_id)
        self.owner._in_flight -= 1


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_queue: int = 256):
        self.engine, self.metrics = engine, metrics
        self.max_num_seqs = engine.config.max_num_seqs
        self.max_queue = max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._in_flight = 0  # HTTP loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._lock = threading.Lock()  # orders submit against the thread's last drain of the inbox
        self.error: BaseException | None = None
        self._step_failures = 0  # engine thread only: failed steps since the last good one

    # ------------------------------------------------------------ HTTP-loop side
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.engine.has_unfinished():
            raise DsquantError("the engine has unfinished requests; an engine serves one EngineLoop at a time")
        self._loop = loop
        self.metrics.baseline(self.engine.stats())
        self._thread = threading.Thread(target=self._run, name="dsquant-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
               arrival: float) -> RequestHandle:
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if not self.alive:
                raise EngineUnavailable("the engine loop is not running")
            if self._in_flight >= self.max_num_seqs + self.max_queue:
                raise QueueFull(f"{self._in_flight} requests in flight; the limit is max_num_seqs "
                                f"{self.max_num_seqs} + max_queue {self.max_queue}")
            tracked = _Tracked(q, arrival, len(prompt_ids), params.max_tokens)
            self._inbox.put(("add", request_id, prompt_ids, params, tracked))
        self._in_flight += 1
        return RequestHandle(self, request_id, q)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the thread and wait for it (thread-safe, idempotent)."""
        with self._lock:
            self._stopping = True
        self._inbox.put(("stop",))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _deliver(self, items: list[tuple[asyncio.Queue, object]]) -> None:
        for q, item in items:
            q.put_nowait(item)

    # ------------------------------------------------------------ engine thread
    def _send(self, items: list) -> None:
        if items and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the HTTP loop has closed: nobody is listening
                pass

    def _run(self) -> None:
        try:
            while self._drain(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._step()
                self.metrics.engine_stats(self.engine.stats())
        except BaseException as e:  # a crashed engine must not leave clients waiting forever
            self.error = e
            log.exception("engine loop crashed")
        finally:
            with self._lock:
                self._stopping = True
            self._abort_all()

    def _drain(self, block: bool) -> bool:
        """Run the inbox's commands; False once told to stop."""
        try:
            cmd = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "stop":
                return False
            if cmd[0] == "add":
                self._add(*cmd[1:])
            elif cmd[0] == "abort" and cmd[1] in self._tracked:
                del self._tracked[cmd[1]]
                self.engine.abort(cmd[1])
                self.metrics.request_finished("abort")
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, tracked: _Tracked) -> None:
        try:
            self.engine.add_request(prompt_ids, params, request_id=request_id)
        except DsquantError as e:
            self._send([(tracked.queue, RequestRejected(str(e)))])
            return
        except Exception as e:  # noqa: BLE001 - a bug for this request, not a reason to stop serving
            log.exception("engine add_request failed for %s", request_id)
            self.engine.abort(request_id)  # in case it was half added
            self._send([(tracked.queue, RequestFailed(f"the engine could not add the request: "
                                                      f"{type(e).__name__}: {e}"))])
            return
        self._tracked[request_id] = tracked

    def _step(self) -> None:
        start, scheduled_tokens = time.monotonic(), self.engine.scheduler.num_scheduled_tokens
        try:
            outputs: list[RequestOutput] = self.engine.step()
        except Exception as e:
            self._step_failed(e)
            return
        self._step_failures = 0
        now = time.monotonic()
        m = self.metrics
        m.step_tokens(self.engine.scheduler.num_scheduled_tokens - scheduled_tokens)
        produced = {o.request_id for o in outputs}
        for rid, tr in self._tracked.items():
            if not tr.scheduled and (rid in produced or self._is_scheduled(rid)):
                tr.scheduled, tr.scheduled_at = True, start
                m.queue_time.observe(max(0.0, start - tr.arrival))
        items = []
        for out in outputs:
            tr = self._tracked.get(out.request_id)
            if tr is None:
                continue
            m.generation_tokens.inc(len(out.new_token_ids))
            if tr.last_token_time is None:
                m.ttft.observe(now - tr.arrival)
                m.prompt_tokens.inc(tr.num_prompt_tokens)
                tr.first_token_time = now
            else:
                m.itl.observe(now - tr.last_token_time)
            tr.last_token_time = now
            if out.finished:
                m.request_completed(tr, now, len(out.token_ids), out.finish_reason or "stop")
                del self._tracked[out.request_id]
            items.append((tr.queue, out))
        self._send(items)

    def _step_failed(self, error: Exception) -> None:
        """Fail and abort every request in the engine; re-raise (stopping the loop) when the
        engine keeps failing or is left with unfinished work."""
        self._step_failures += 1
        if self._step_failures >= MAX_STEP_FAILURES:
            raise error
        log.exception("engine step failed (%d in a row); failing its %d requests", self._step_failures,
                      len(self._tracked))
        failure = f"the engine step failed: {type(error).__name__}: {error}"
        items, consistent = [], True
        for rid, tr in list(self._tracked.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the engine cannot even abort: stop below
                log.exception("aborting %s after a failed step failed too", rid)
                consistent = False
            self.metrics.request_finished("abort")
            items.append((tr.queue, RequestFailed(failure)))
        self._tracked.clear()
        self._send(items)
        if not consistent or self.engine.has_unfinished():
            raise error

    def _is_scheduled(self, request_id: str) -> bool:
        entry = self.engine.requests.get(request_id)
        return entry is not None and entry[0].status != SequenceStatus.WAITING

    def _abort_all(self) -> None:
        items = []
        reason = "the engine loop crashed" if self.error else "the server is shutting down"
        for rid, tr in list(self._tracked.items()):
            self.engine.abort(rid)
            self.metrics.request_finished("abort")
            items.append((tr.queue, EngineUnavailable(reason)))
        self._tracked.clear()
        while True:  # requests that never reached the engine
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                items.append((cmd[4].queue, EngineUnavailable(reason)))
        self._send(items)
        try:
            self.metrics.engine_stats(self.engine.stats())
        except Exception:  # noqa: BLE001 - best effort after a crash
            pass
