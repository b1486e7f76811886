"""Graceful shutdown of the HTTP server, as production servers do it: stop accepting connections, let the open
requests finish for up to ``shutdown_timeout`` seconds, then end each one that is left: a stream with a final chunk
(``finish_reason: "abort"``) and ``[DONE]``, a whole request with a 503 and OpenAI's error body. Their KV is freed.

``Drain`` is the app's view (which requests are open, ending them); ``GracefulServer`` is uvicorn's server with its
exit signal turned into a drain. A second exit request (signal or call) ends what is open at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import weakref
from types import FrameType
from typing import Any

import uvicorn

from compile_attn.engine.serving.streams import EngineStoppedError, RequestStream

logger = logging.getLogger(__name__)


class ServerShuttingDownError(EngineStoppedError):
    """The server is shutting down: the request was ended before it finished (a stream gets a final chunk with
    finish_reason "abort", a whole request a 503)."""


class Drain:
    """The requests an app is serving (their RequestStreams, weakly held) and its shutdown: ``draining`` (the app
    refuses new requests), ``run(timeout)`` (wait, then end what is left)."""

    def __init__(self) -> None:
        self._streams: weakref.WeakSet[RequestStream] = weakref.WeakSet()
        self.draining = False

    def track(self, streams: list[RequestStream]) -> None:
        self._streams.update(streams)

    def num_open(self) -> int:
        return sum(not s.finished for s in list(self._streams))

    def end_all(self) -> None:
        """End every open request now (on the app's event loop)."""
        exc = ServerShuttingDownError("the server is shutting down; the request was ended before it finished")
        for s in list(self._streams):
            s.end(exc)

    async def run(self, timeout: float) -> None:
        """Refuse new requests, wait up to ``timeout`` seconds for the open ones, then end the rest and give their
        handlers a moment to answer."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.num_open() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = self.num_open()
        if left:
            logger.warning("shutting down: %d request(s) still open after %.1f s are ended", left, timeout)
            self.end_all()
            await asyncio.sleep(0.05)  # their handlers write the last chunk or the 503


class GracefulServer(uvicorn.Server):
    """uvicorn's server whose exit (a signal, or ``begin_shutdown()`` from any thread) first drains ``drain`` for
    up to ``shutdown_timeout`` seconds, with the listening sockets closed; the process then exits normally (the
    signal is not re-raised). ``ignore_sigint``: a process whose parent handles Ctrl-C for it (the front end)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, shutdown_timeout: float, *,
                 ignore_sigint: bool = False) -> None:
        super().__init__(config)
        self.drain, self.shutdown_timeout, self.ignore_sigint = drain, shutdown_timeout, ignore_sigint
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGINT and self.ignore_sigint:
            return
        self.begin_shutdown()

    def begin_shutdown(self) -> None:
        """Start the drain (thread-safe); a second call ends the open requests at once."""
        loop = self._loop
        if loop is None or loop.is_closed():  # not serving yet (or any more)
            self.should_exit = True
            return
        try:
            loop.call_soon_threadsafe(self._begin)
        except RuntimeError:  # the loop closed meanwhile
            self.should_exit = True

    def _begin(self) -> None:
        if self._drain_task is not None:
            self.drain.end_all()
            return
        for server in self.servers:  # stop accepting: new connections are refused from now on
            server.close()
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.run(self.shutdown_timeout)
        finally:
            self.should_exit = True
