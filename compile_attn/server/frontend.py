"""Where the HTTP front end of an AsyncLLM runs: in a process of its own (``serve_in_process``: the OpenAI-compatible
app on an EngineClient, talking over a pipe to the AsyncLLM in the engine's process, see
``compile_attn.engine.engine_pipe``) or in a thread of the engine's process (``serve_in_thread``).

A process of its own is how ``compile-attn serve`` and ``compile-attn bench-serve`` run by default: parsing
requests, detokenising and formatting a server-sent event per token then never compete with the engine's step loop
for the interpreter lock (in one process, at a few hundred streams, that per-token work costs more than the GPU
step it must hide behind). Both yield the base URL once the server answers.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine is imported where a server starts, not by the CLI's option parsing
    from compile_attn.engine.serving.async_engine import AsyncLLM

logger = logging.getLogger(__name__)
GRACEFUL_SHUTDOWN_S = 3  # seconds a stopping front end waits for open connections


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def frontend_main(conn: Connection, tokenizer: Any, max_context: int, model_name: str, host: str, port: int,
                  log_level: str) -> None:
    """The front end process: the app on an EngineClient of ``conn``, served by uvicorn until terminated."""
    import uvicorn

    from compile_attn.engine.serving.engine_pipe import EngineClient
    from compile_attn.server.app import create_app

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.WARNING))
    client = EngineClient(conn, tokenizer=tokenizer, max_context=max_context)
    # on SIGTERM (serve_in_process's exit): stop accepting, give open streams a moment, then close them
    server = uvicorn.Server(uvicorn.Config(create_app(client, model_name), host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    threading.Thread(target=_exit_with_parent, args=(server,), name="compile-attn-parent-watch", daemon=True).start()
    server.run()


def _exit_with_parent(server: Any) -> None:
    """Stop ``server`` once the engine's process is gone (killed without a chance to stop its front end), so that
    no orphan keeps the port."""
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is None:
        return
    wait([parent.sentinel])  # blocks in the kernel until the parent exits
    logger.warning("the engine's process is gone; the front end stops")
    server.should_exit = True


@contextlib.contextmanager
def serve_in_process(engine: AsyncLLM, model_name: str, *, host: str = "127.0.0.1", port: int | None = None,
                     log_level: str = "warning", start_timeout: float = 120.0) -> Iterator[str]:
    """Start the front end of ``engine`` in a new process on ``host:port`` (a free port when None); yield its base
    URL once it answers ``/health``; stop it after (its unfinished requests are aborted, their KV freed). The
    engine's ``max_pending`` bounds the requests in flight (past it: 503)."""
    from compile_attn.engine.serving.engine_pipe import PipeBridge

    port = free_port(host) if port is None else port
    ctx = multiprocessing.get_context("spawn")  # the engine's process has CUDA: never fork it
    ours, theirs = ctx.Pipe()
    bridge = PipeBridge(engine, ours)
    proc = ctx.Process(target=frontend_main, name="compile-attn-frontend", daemon=True,
                       args=(theirs, engine.tokenizer, engine.max_context, model_name, host, port, log_level))
    proc.start()
    theirs.close()
    url = f"http://{host}:{port}"
    try:
        _wait_healthy(url, proc, start_timeout)
        logger.info("front end (pid %d) serving on %s", proc.pid, url)
        yield url
    finally:
        proc.terminate()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
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
                    log_level: str = "warning", start_timeout: float = 60.0) -> Iterator[str]:
    """The app on ``engine`` served by uvicorn in a thread of this process on ``host:port`` (a free port when
    None); yields its base URL once started and stops the server after (the engine keeps running)."""
    import uvicorn

    from compile_attn.server.app import create_app

    port = free_port(host) if port is None else port
    server = uvicorn.Server(uvicorn.Config(create_app(engine, model_name), host=host, port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, name="compile-attn-http", daemon=True)
    thread.start()
    try:
        end = time.monotonic() + start_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the server did not start on {host}:{port}")
            time.sleep(0.02)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def serving(engine: AsyncLLM, model_name: str, frontend: str = "process", **options: Any) -> Iterator[str]:
    """``serve_in_process`` (``frontend="process"``) or ``serve_in_thread`` (``"thread"``) with ``options``."""
    if frontend not in FRONTENDS:
        raise ValueError(f"frontend must be one of {FRONTENDS}, got {frontend!r}")
    serve = serve_in_process if frontend == "process" else serve_in_thread
    with serve(engine, model_name, **options) as url:
        yield url


FRONTENDS = ("process", "thread")
