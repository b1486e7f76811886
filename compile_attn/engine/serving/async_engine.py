"""AsyncLLM: one ``LLM`` driven by a step loop in its own thread, fed from asyncio coroutines.

Only the loop thread calls the LLM (add_request, step, abort_request); coroutines hand it work through a thread-safe
queue and receive each request's new tokens and text after every step through an asyncio queue. A consumer that
stops listening aborts its request at once (its KV is freed); past ``max_pending`` unfinished requests, new ones get
EngineOverloadedError.

A step that raises is retried: ``LLM.step`` is all-or-nothing (a failed step is undone, its requests are as
before), so a passing fault costs nothing. A request whose own output is the fault does not raise: the LLM finishes
it alone with reason "error" and the others go on. A step that still fails after ``max_step_retries`` retries fails
every active request with its exception: the exception names no request, and the same batch fails the same way
again, so no request can be singled out as the cause; the loop then goes on serving new requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from multiprocessing.connection import wait
from typing import Any

from compile_attn.engine.llm import LLM
from compile_attn.engine.requests.request import RequestStatus
from compile_attn.engine.requests.sampling_params import SamplingParams
from compile_attn.engine.serving.detokenizer import detokenizer_for
from compile_attn.engine.serving.inbox import Inbox
from compile_attn.engine.serving.loop_stats import LoopStats
from compile_attn.engine.serving.streams import (Delta, EngineOverloadedError, EngineStoppedError, LoopSink, Port,
                                                 RequestStream, StreamState)

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Serve one LLM to many coroutines. ``generate(prompt, params)`` is an async iterator of Delta; ``submit``
    admits a request first (raising the LLM's InvalidRequestError for a bad one) and returns that iterator.
    ``stats`` counts the steps run (see LoopStats); ``call(fn)`` runs ``fn(llm)`` on the loop thread."""

    def __init__(self, llm: LLM, *, max_pending: int = 256, max_step_retries: int = 2) -> None:
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
        if not isinstance(max_step_retries, int) or max_step_retries < 0:
            raise ValueError(f"max_step_retries must be an int >= 0, got {max_step_retries!r}")
        self.llm, self.max_pending, self.max_step_retries = llm, max_pending, max_step_retries
        self.stats = LoopStats()
        self.num_failed_steps = 0  # step() calls that raised (each undone by the LLM)
        self._inbox = Inbox()  # commands for the loop thread, and the pipe that wakes it (see inbox.py)
        self._ports: list[Port] = []  # loop thread only: consumers in other processes (``attach``)
        self._active: dict[int, StreamState] = {}  # loop thread only: request_id -> stream
        self._loop_sinks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its LoopSink
        self._pending = 0
        self._count_lock = threading.Lock()
        self._stopped = False
        self.num_aborted = 0  # requests dropped unfinished (consumer gone, failed step, shutdown)
        self._thread = threading.Thread(target=self._loop, name="compile-attn-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any coroutine
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    async def submit(self, prompt: Any, params: SamplingParams) -> RequestStream:
        """Queue one request (one sample: ``params.n`` must be 1) and return its Delta iterator once the loop has
        admitted it. Raises EngineOverloadedError past ``max_pending``, the LLM's errors for a bad request."""
        if not self.alive:
            raise EngineStoppedError("the engine is shut down; start a new AsyncLLM")
        refused = self._reserve()
        if refused is not None:
            raise refused
        out: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        sink = self._loop_sinks.get(loop)
        if sink is None:  # one sink per event loop: a step's Deltas for that loop go in one call
            sink = self._loop_sinks[loop] = LoopSink(loop)
        stream = StreamState(sink, out)
        self._post(("add", prompt, params, stream))
        try:
            first = await out.get()
        except BaseException:  # cancelled while waiting for admission: drop the request once admitted
            self._post(("abort", stream))
            raise
        if isinstance(first, BaseException):
            raise first
        return RequestStream(self, stream)

    async def generate(self, prompt: Any, params: SamplingParams) -> AsyncIterator[Delta]:
        """The request's Deltas as they are produced; the last has ``finished=True``. Closing or cancelling the
        iteration early aborts the request."""
        stream = await self.submit(prompt, params)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.abort()

    def call(self, fn: Callable[[LLM], Any]) -> Future:
        """Run ``fn(llm)`` on the loop thread between two steps (while the loop runs, no other thread may touch the
        LLM); returns a ``concurrent.futures.Future`` of its result, e.g. ``engine.call(lambda llm:
        llm.kv_cache.prefix_cache.clear()).result()``. EngineStoppedError once shut down."""
        if not self.alive:
            raise EngineStoppedError("the engine is shut down; call the LLM directly")
        fut: Future = Future()
        self._post(("call", fn, fut))
        return fut

    def abort_stream(self, stream: StreamState) -> None:
        """Drop ``stream``'s request (if still running) on the loop thread; its KV is freed there."""
        self._command(("abort", stream))

    def attach(self, port: Port) -> None:
        """Have the loop serve ``port`` (a consumer in another process, see ``Port``) between steps and wait on it
        when idle; its methods all run on the loop thread."""
        self._post(("attach", port))

    def detach(self, port: Port) -> None:
        """Stop serving ``port`` (its ``on_close`` runs on the loop thread; it only releases its channel once the
        loop has ended)."""
        if self.alive:
            self._post(("detach", port))
        else:
            port.release()

    def add_stream(self, prompt: Any, params: SamplingParams, stream: StreamState) -> None:
        """Queue a request whose items go to ``stream.sink`` (its admission, an error, its Deltas): the entry for a
        consumer in another process (``engine_pipe``). Counts toward ``num_pending`` until it ends; past
        ``max_pending`` the stream gets EngineOverloadedError instead."""
        refused = self._reserve()
        if refused is not None:
            stream.put(refused)
        elif not self.alive:
            self._release()
            stream.put(EngineStoppedError("the engine is shut down"))
        else:
            self._command(("add", prompt, params, stream))

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    @property
    def max_context(self) -> int:
        return self.llm.kv_cache.max_context

    @property
    def kv_cache_dtype(self) -> str:
        """The engine's KV cache dtype: "auto" (the model's), "fp8_e4m3" or "fp8_e5m2"."""
        return self.llm.config.kv_cache_dtype

    def gauges(self) -> dict[str, float]:
        """Requests running / waiting / pending, the KV cache's used fraction and capacity (tokens), and with
        speculative decoding the drafts verified and accepted since start; read without a lock from the loop's
        state (len() is atomic; a reading may be one step stale)."""
        llm = self.llm
        kv = llm.kv_cache
        capacity = kv.allocator.num_pages * kv.page_size
        spec = llm.speculator.stats if llm.speculator is not None else None
        return {"running": len(llm.scheduler.running), "waiting": len(llm.scheduler.waiting),
                "pending": self._pending, "kv_usage": 1.0 - kv.available_tokens / capacity,
                "kv_capacity_tokens": capacity, "spec_drafts": spec.verified if spec else 0,
                "spec_draft_tokens": spec.draft_tokens if spec else 0,
                "spec_accepted_tokens": spec.accepted_tokens if spec else 0}

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop: unfinished requests end with finish_reason "abort" and their KV is freed."""
        if self._stopped:
            return
        self._stopped = True
        self._post(("stop",))
        self._thread.join(timeout)

    @property
    def num_pending(self) -> int:
        """Requests submitted and not yet finished or aborted."""
        return self._pending

    def _reserve(self) -> EngineOverloadedError | None:
        """Count one more unfinished request, or the error that refuses it (``max_pending`` reached)."""
        with self._count_lock:
            if self._pending >= self.max_pending:
                return EngineOverloadedError(f"{self._pending} requests are unfinished, the limit (max_pending) "
                                             f"is {self.max_pending}; retry later or raise max_pending")
            self._pending += 1
        return None

    def _release(self) -> None:
        with self._count_lock:
            self._pending -= 1

    def _post(self, cmd: tuple) -> None:
        """Queue ``cmd`` for the loop thread and wake it if idle."""
        self._inbox.post(cmd)

    def _command(self, cmd: tuple) -> None:
        """Run ``cmd`` now when on the loop thread (a pipe's message), else queue it."""
        if threading.get_ident() == self._thread.ident:
            self._handle(cmd)
        else:
            self._post(cmd)

    # ------------------------------------------------------------------ the loop thread
    def _loop(self) -> None:
        failures = 0  # step() calls failed in a row
        try:
            while True:
                if not self.llm.has_work():
                    for port in list(self._ports):
                        port.on_idle()
                    if not any(port.readable() for port in self._ports):
                        t0 = time.perf_counter()
                        wait([self._inbox.wake_fd, *(w for port in self._ports for w in port.waitables())])
                        self.stats.add_idle(time.perf_counter() - t0)
                t1 = time.perf_counter()
                if self._drain_commands():
                    return
                self._read_ports()
                if not self.llm.has_work():
                    self.stats.add_other(time.perf_counter() - t1)
                    continue
                launched = self.llm.num_steps
                before = {id(r) for r in self.llm.scheduler.running}
                start = time.perf_counter()
                self.stats.add_other(start - t1)
                try:
                    self.llm.step()
                except Exception as exc:
                    self.num_failed_steps += 1
                    failures += 1
                    if failures <= self.max_step_retries:  # the LLM undid the step: run it again
                        logger.warning("engine step failed (%s: %s); it was undone, retry %d of %d",
                                       type(exc).__name__, exc, failures, self.max_step_retries)
                        continue
                    logger.exception("engine step failed %d times in a row; failing the %d active requests",
                                     failures, len(self._active))
                    failures = 0
                    for stream in list(self._active.values()):
                        self._abort(stream, exc)
                    continue
                failures = 0
                if self.llm.num_steps != launched:  # a step ran (not only the last one's tokens read)
                    # its batch: the requests running before it and those it admitted (one finishing in it, or
                    # retired at its length limit, has left ``running`` by now)
                    batch = len(before) + sum(id(r) not in before for r in self.llm.scheduler.running)
                    self.stats.record(batch, time.perf_counter() - start)
                else:
                    self.stats.add_other(time.perf_counter() - start)
                t2 = time.perf_counter()
                self._publish()
                self.stats.add_other(time.perf_counter() - t2)
        except BaseException:
            logger.exception("the engine loop died")
            self._stopped = True
            raise
        finally:
            for port in self._ports:
                try:
                    port.on_idle()  # what the last steps (or the stop) left for it
                except Exception:  # noqa: BLE001 - the port's peer may be gone; its channel is released next
                    logger.debug("flushing a port at the loop's end failed", exc_info=True)
                port.release()
            self._inbox.close()

    def _drain_commands(self) -> bool:
        """Handle every queued command; True on "stop" (the loop then ends)."""
        self._inbox.drain_wakeups()
        while (cmd := self._inbox.get()) is not None:
            if cmd[0] == "stop":
                self._stop_all()
                return True
            self._handle(cmd)
        return False

    def _read_ports(self) -> None:
        """Every command the attached ports hold now; a port whose peer is gone is dropped (its on_close)."""
        for port in list(self._ports):
            if not port.pump():
                self._ports.remove(port)
                port.on_close()

    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, prompt, params, stream = cmd
            try:
                stream.req = self.llm.add_request(prompt, params)
            except Exception as exc:
                self._release()
                stream.put(exc)
                return
            stream.admitted_at = time.perf_counter()
            self._active[stream.req.request_id] = stream
            if stream.wants_text and self.llm.tokenizer is not None:
                stream.detok = detokenizer_for(self.llm.tokenizer, stream.req.params)
            stream.put(None)  # admitted
            if stream.gone:
                self._abort(stream, None)
        elif cmd[0] == "abort":
            stream = cmd[1]
            if stream.req is not None and stream.req.request_id in self._active:
                self._abort(stream, None)
        elif cmd[0] == "attach":
            self._ports.append(cmd[1])
        elif cmd[0] == "detach":
            port = cmd[1]
            if port in self._ports:
                self._ports.remove(port)
                port.on_close()
        elif cmd[0] == "call":
            _, fn, fut = cmd
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.llm))
                except Exception as exc:
                    fut.set_exception(exc)

    def _abort(self, stream: StreamState, exc: BaseException | None) -> None:
        req = stream.req
        if req.status is not RequestStatus.FINISHED:
            self.llm.abort_request(req)
            self.num_aborted += 1
        del self._active[req.request_id]
        self._release()
        if exc is not None:
            stream.put(exc)

    def _stop_all(self) -> None:
        for stream in list(self._active.values()):
            self._abort(stream, None)
            stream.put(stream.next_delta(finished=True))
        while (cmd := self._inbox.get()) is not None:  # what came in after "stop" is refused, not left waiting
            stopped = EngineStoppedError("the engine was shut down before this reached it")
            if cmd[0] == "add":
                self._release()
                cmd[3].put(stopped)
            elif cmd[0] == "call" and cmd[2].set_running_or_notify_cancel():
                cmd[2].set_exception(stopped)

    def _publish(self) -> None:
        """After a step: each request's new tokens (and finished ones' last Delta) to its consumer, handed to each
        sink in one call (a call per request would wake an event loop once per request)."""
        by_sink: dict[Any, list[tuple[StreamState, Any]]] = {}
        ended = []
        finished = RequestStatus.FINISHED
        for stream in self._active.values():
            req = stream.req
            done = req.status is finished
            known = req.num_output_known
            if done or known > stream.sent_tokens:
                if stream.sent_tokens == 0 and known:
                    self.stats.add_first_token(time.perf_counter() - stream.admitted_at)
                items = by_sink.get(stream.sink)
                if items is None:
                    items = by_sink[stream.sink] = []
                items.append((stream, stream.next_delta(finished=done, known=known)))
            if done:
                ended.append(stream)
        for stream in ended:
            del self._active[stream.req.request_id]
            self._release()
        start = time.perf_counter()
        for items in by_sink.values():
            try:
                items[0][0].sink.deliver(items)
            except RuntimeError:  # that event loop has closed: nobody reads its streams any more
                for stream, _ in items:
                    stream.gone = True
        if by_sink:
            self.stats.add_deliver(time.perf_counter() - start)
        for stream in list(self._active.values()):
            if stream.gone:
                self._abort(stream, None)
