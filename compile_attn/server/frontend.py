"""Where the HTTP front end of an AsyncLLM runs: in a process of its own (``serve_in_process``: the OpenAI-compatible
app on an EngineClient, talking over a channel to the AsyncLLM in the engine's process, see
``compile_attn.engine.serving.engine_pipe``) or in a thread of the engine's process (``serve_in_thread``).

A process of its own is how ``compile-attn serve`` and ``compile-attn bench-serve`` run by default: parsing
requests, detokenising and formatting a server-sent event per token then never compete with the engine's step loop
for the interpreter lock (in one process, at a few hundred streams, that per-token work costs more than the GPU
step it must hide behind). Both yield a ``FrontEnd`` (its ``url``) once the server answers and stop it gracefully
(``compile_attn.server.shutdown``): a stopping server lets its open requests finish for a while, then ends them
with a final chunk or a 503.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine and uvicorn are imported where a server starts, not by the CLI's option parsing
    from compile_attn.engine.serving.async_engine import AsyncLLM
    from compile_attn.engine.serving.channel import ChannelAddress
    from compile_attn.server.shutdown import GracefulServer
    from compile_attn.server.options import ServerOptions

logger = logging.getLogger(__name__)
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0  # how long a stopping server lets open requests run before ending them
END_GRACE_S = 2.0  # after that: how long uvicorn waits for the last answers before closing connections


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class FrontEnd:
    """A running HTTP front end: its base ``url``; ``alive()``; ``request_stop()`` (begin the graceful shutdown:
    no new connections, open requests run for up to ``shutdown_timeout`` seconds, then are ended; a second call
    ends them at once); ``stop()`` (request it and wait until it is done)."""

    def __init__(self, url: str, shutdown_timeout: float) -> None:
        self.url, self.shutdown_timeout = url, shutdown_timeout

    def alive(self) -> bool:
        raise NotImplementedError

    def request_stop(self) -> None:
        raise NotImplementedError

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the front end to end; whether it did."""
        raise NotImplementedError

    def stop(self) -> None:
        if self.alive():
            self.request_stop()
        if not self.join(self.shutdown_timeout + END_GRACE_S + 10):
            logger.warning("the HTTP front end did not stop in time; stopping it now")
            self._force_stop()

    def _force_stop(self) -> None:
        raise NotImplementedError


class _ProcessFrontEnd(FrontEnd):
    def __init__(self, url: str, shutdown_timeout: float, proc: multiprocessing.process.BaseProcess) -> None:
        super().__init__(url, shutdown_timeout)
        self.proc = proc

    @property
    def exitcode(self) -> int | None:
        return self.proc.exitcode

    def alive(self) -> bool:
        return self.proc.is_alive()

    def request_stop(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()  # SIGTERM: its GracefulServer drains

    def join(self, timeout: float) -> bool:
        self.proc.join(timeout)
        return not self.proc.is_alive()

    def _force_stop(self) -> None:
        self.proc.kill()
        self.proc.join(5)


class _ThreadFrontEnd(FrontEnd):
    exitcode = None

    def __init__(self, url: str, shutdown_timeout: float, server: GracefulServer, thread: threading.Thread) -> None:
        super().__init__(url, shutdown_timeout)
        self.server, self.thread = server, thread

    def alive(self) -> bool:
        return self.thread.is_alive()

    def request_stop(self) -> None:
        self.server.begin_shutdown()

    def join(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def _force_stop(self) -> None:
        self.server.force_exit = True
        self.thread.join(10)


def frontend_main(address: ChannelAddress, tokenizer: Any, max_context: int, model_name: str, host: str, port: int,
                  log_level: str, shutdown_timeout: float, options: ServerOptions | None = None,
                  kv_cache_dtype: str = "auto") -> None:
    """The front end process: the app on an EngineClient connected to ``address``, served by uvicorn until
    SIGTERM (then drained, see GracefulServer) or until the engine's process is gone; ``options`` is the app's (create_app)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the engine's process, which stops this one
    import uvicorn

    from compile_attn.engine.serving.engine_pipe import EngineClient
    from compile_attn.server.app import create_app
    from compile_attn.server.shutdown import GracefulServer

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.WARNING))
    client = EngineClient(address, tokenizer=tokenizer, max_context=max_context, kv_cache_dtype=kv_cache_dtype)
    app = create_app(client, model_name, options)
    server = GracefulServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=END_GRACE_S),
                            app.state.drain, shutdown_timeout, ignore_sigint=True)
    threading.Thread(target=_exit_with_parent, args=(server,), name="compile-attn-parent-watch", daemon=True).start()
    try:
        server.run()
    finally:
        client.close()
    # Nothing of ours is left to clean up; the interpreter's own teardown of the compiler stack the package imports
    # takes ~2 s more, which a stopping server would spend holding its parent up: end the process here.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_with_parent(server: GracefulServer) -> None:
    """Stop ``server`` once the engine's process is gone (killed without a chance to stop its front end), so that
    no orphan keeps the port."""
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is None:
        return
    wait([parent.sentinel])  # blocks in the kernel until the parent exits
    logger.error("the engine's process is gone; the HTTP front end stops")
    server.begin_shutdown()  # its requests have failed already (the engine's channel closed): nothing to wait for


@contextlib.contextmanager
def serve_in_process(engine: AsyncLLM, model_name: str, *, host: str = "127.0.0.1", port: int | None = None,
                     log_level: str = "warning", start_timeout: float = 120.0,
                     shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
                     options: ServerOptions | None = None) -> Iterator[FrontEnd]:
    """Start the front end of ``engine`` in a new process on ``host:port`` (a free port when None); yield it once it
    answers ``/health``; stop it gracefully after (``FrontEnd.stop``), then disconnect it from the engine (what is
    still unfinished is aborted, its KV freed). The engine's ``max_pending`` bounds the requests in flight (past it:
    503); ``options`` is the app's (create_app)."""
    from compile_attn.engine.serving.engine_pipe import PipeBridge

    port = free_port(host) if port is None else port
    ctx = multiprocessing.get_context("spawn")  # the engine's process has CUDA: never fork it
    bridge = PipeBridge(engine)
    proc = ctx.Process(target=frontend_main, name="compile-attn-frontend", daemon=True,
                       args=(bridge.address, engine.tokenizer, engine.max_context, model_name, host, port, log_level,
                             shutdown_timeout, options, engine.kv_cache_dtype))
    try:
        proc.start()
    finally:
        bridge.address.lifeline.close()  # the front end's end lives in its process only: its death is then seen
    front = _ProcessFrontEnd(f"http://{host}:{port}", shutdown_timeout, proc)
    try:
        _wait_healthy(front.url, proc, start_timeout)
        logger.info("front end (pid %d) serving on %s", proc.pid, front.url)
        yield front
    finally:
        front.stop()
        bridge.close()


def direct_opener() -> urllib.request.OpenerDirector:
    """A urllib opener that never goes through a proxy (the server is on loopback)."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def healthy(url: str, timeout: float = 2.0) -> bool:
    """Whether the server at ``url`` answers ``GET /health`` with 200 (asked directly, never through a proxy)."""
    try:
        with direct_opener().open(url + "/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):  # refused, reset, timed out, or an error status (503: stopped)
        return False


def _wait_healthy(url: str, proc: multiprocessing.process.BaseProcess, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not healthy(url):
        if not proc.is_alive():
            raise RuntimeError(f"the front end process exited (code {proc.exitcode}) before serving on {url}")
        if time.monotonic() > end:
            raise RuntimeError(f"the front end did not answer {url}/health within {timeout:.0f} s")
        time.sleep(0.05)


@contextlib.contextmanager
def serve_in_thread(engine: AsyncLLM, model_name: str, *, host: str = "127.0.0.1", port: int | None = None,
                    log_level: str = "warning", start_timeout: float = 60.0,
                    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
                    options: ServerOptions | None = None) -> Iterator[FrontEnd]:
    """The app on ``engine`` (with ``options``, see create_app) served by uvicorn in a thread of this process on ``host:port`` (a free port when
    None); yields it once started and stops it gracefully after (the engine keeps running)."""
    import uvicorn

    from compile_attn.server.app import create_app
    from compile_attn.server.shutdown import GracefulServer

    port = free_port(host) if port is None else port
    app = create_app(engine, model_name, options)
    server = GracefulServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=END_GRACE_S), app.state.drain, shutdown_timeout)
    thread = threading.Thread(target=server.run, name="compile-attn-http", daemon=True)
    thread.start()
    front = _ThreadFrontEnd(f"http://{host}:{port}", shutdown_timeout, server, thread)
    try:
        end = time.monotonic() + start_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the server did not start on {host}:{port}")
            time.sleep(0.02)
        yield front
    finally:
        front.stop()


@contextlib.contextmanager
def serving(engine: AsyncLLM, model_name: str, frontend: str = "process", options: ServerOptions | None = None,
            **kwargs: Any) -> Iterator[FrontEnd]:
    """``serve_in_process`` (``frontend="process"``) or ``serve_in_thread`` (``"thread"``) with the app's
    ``options`` and their keyword arguments ``kwargs``."""
    if frontend not in FRONTENDS:
        raise ValueError(f"frontend must be one of {FRONTENDS}, got {frontend!r}")
    serve = serve_in_process if frontend == "process" else serve_in_thread
    with serve(engine, model_name, options=options, **kwargs) as front:
        yield front


FRONTENDS = ("process", "thread")
