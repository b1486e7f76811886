"""An AsyncLLM served to another process over a pipe: ``PipeBridge`` on the engine's side, ``EngineClient`` (the
AsyncLLM's consumer interface: ``submit``, ``alive``, ``num_pending``, ``tokenizer``, ``max_context``, ``gauges``)
on the other.

Why: a consumer in the engine's process (an HTTP server formatting a chunk per token, say) competes with the step
loop for the interpreter lock, and at a few hundred streams its per-token work outgrows the GPU step it must hide
behind. Behind the pipe the engine process does only the steps: one message per step carries every request's new
token ids (and the engine's gauges), and the consumer's process detokenises and formats them.

Messages (pickled by ``multiprocessing.connection``): to the engine ``("add", key, prompt, params)`` and
``("abort", key)``; from it ``("out", [(key, item), ...], gauges)`` where an item is None (admitted), an exception
(refused or failed) or ``Delta.fields()`` (token ids, no text: the client's IncrementalDetokenizer makes
it). A closed pipe on
either side ends what it served: the engine aborts the client's requests (their KV is freed), the client fails its
streams with EngineStoppedError.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import logging
import pickle
import struct
import termios
import threading
from multiprocessing.connection import Connection
from typing import Any

from compile_attn.engine.serving.async_engine import (AsyncLLM, Delta, EngineStoppedError, RequestStream, _Stream,
                                              merge_fields)
from compile_attn.engine.serving.detokenizer import IncrementalDetokenizer
from compile_attn.engine.requests.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _unread_bytes(conn: Connection) -> int:
    """Bytes written to ``conn`` that its other end has not read yet (Linux: the socket's output queue); 0 where
    the platform does not tell."""
    try:
        return struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError, AttributeError):  # AttributeError: no TIOCOUTQ on this platform
        return 0


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception type may fail to pickle
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class PipeBridge:
    """The engine's side: the AsyncLLM's loop reads the client's commands between steps (``AsyncLLM.attach``) and
    sends each step's items (``deliver``) as one message. ``close()`` (or the client's end closing) aborts what is
    left.

    A client that falls behind never stalls the steps: while more than ``max_backlog`` bytes it was sent are still
    unread (the socket's output queue), a step's items wait here, each request's tokens merged into one item, and
    go out in one message once the client has caught up (or the loop runs out of work). The client then gets
    fewer, longer items, which costs it less per token, so it catches up."""

    takes_fields = True  # the loop hands it Delta.fields() tuples, not Deltas: the client detokenises
    max_backlog = 64 * 1024  # unread bytes past which items wait here (merged)

    def __init__(self, engine: AsyncLLM, conn: Connection) -> None:
        self.engine, self.conn = engine, conn
        self._streams: dict[int, _Stream] = {}
        self._send_lock = threading.Lock()
        self._held: list[list] = []  # [key, item] waiting for the client, in order
        self._held_tokens: dict[int, int] = {}  # key -> index in _held of its last item when that is a token tuple
        self.num_held = 0  # deliveries that waited (a measure of how far the client lags)
        engine.attach(conn, self._on_message, self._abort_all, self.flush)

    def deliver(self, items: list[tuple[_Stream, Any]]) -> None:
        """Called on the loop thread: the items of one step (or one admission), sent as one message with any that
        waited before them, or kept (merged per request) while the client lags. RuntimeError if the client's end is
        gone (the loop then aborts those requests)."""
        held, tokens = self._held, self._held_tokens
        for stream, item in items:
            key = stream.key
            if item.__class__ is tuple:  # Delta.fields(): a tuple pickles several times faster than a Delta
                if item[1]:  # finished
                    self._streams.pop(key, None)
                at = tokens.get(key)
                if at is not None:  # its earlier tokens still wait: one item with both
                    held[at][1] = merge_fields(held[at][1], item)
                    continue
                tokens[key] = len(held)
            else:
                if isinstance(item, BaseException):
                    item = _portable(item)
                    self._streams.pop(key, None)
                tokens.pop(key, None)  # later tokens go after this item, not into an earlier one
            held.append([key, item])
        if _unread_bytes(self.conn) > self.max_backlog:
            self.num_held += 1
            return
        self._send_held()

    def flush(self) -> None:
        """On the loop thread when it has no work: send what waits, whatever the client's backlog."""
        if self._held:
            try:
                self._send_held()
            except RuntimeError:  # the client is gone: the pipe's closing aborts its requests
                self._held.clear()
                self._held_tokens.clear()

    def _send_held(self) -> None:
        out = [(key, item) for key, item in self._held]
        self._held.clear()
        self._held_tokens.clear()
        try:
            with self._send_lock:
                self.conn.send(("out", out, self.engine.gauges()))
        except (OSError, EOFError, ValueError) as exc:  # ValueError: the connection was closed here
            raise RuntimeError(f"the engine's client is gone ({exc})") from None

    def _on_message(self, msg: tuple) -> None:
        """On the loop thread: one command of the client."""
        if msg[0] == "add":
            _, key, prompt, params = msg
            stream = _Stream(self, key=key)
            self._streams[key] = stream
            self.engine.add_stream(prompt, params, stream)
        elif msg[0] == "abort":
            stream = self._streams.pop(msg[1], None)
            if stream is not None:
                self.engine.abort_stream(stream)
        else:
            logger.warning("engine pipe: unknown message %r", msg[0])

    def _abort_all(self) -> None:
        for stream in list(self._streams.values()):
            stream.gone = True
            self.engine.abort_stream(stream)
        self._streams.clear()

    def close(self) -> None:
        """Close the engine's end (on the loop thread): the client sees the engine stopped; its requests are
        aborted here."""
        self.engine.detach(self.conn)


class _ClientStream:
    """One request on the client's side: its queue of Deltas, its admission, its text so far."""

    def __init__(self, key: int, admitted: asyncio.Future, detok: IncrementalDetokenizer | None) -> None:
        self.key, self.admitted, self.detok = key, admitted, detok
        self.out: asyncio.Queue = asyncio.Queue()
        self.token_ids: list[int] = []
        self.open = True  # counted in num_pending


class EngineClient:
    """The AsyncLLM interface in another process than the engine, over ``conn`` (the other end of a PipeBridge's).
    Needs the engine's ``tokenizer`` (None: no text) and ``max_context``; the engine refuses requests past its
    ``max_pending`` (EngineOverloadedError from ``submit``). Used from one asyncio event loop (the first
    ``submit``'s)."""

    def __init__(self, conn: Connection, *, tokenizer: Any, max_context: int) -> None:
        self.conn, self.tokenizer, self.max_context = conn, tokenizer, max_context
        self._streams: dict[int, _ClientStream] = {}
        self._keys = itertools.count()
        self._pending = 0
        self._gauges: dict[str, float] = {"running": 0, "waiting": 0, "pending": 0, "kv_usage": 0.0,
                                          "kv_capacity_tokens": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._send_lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return not self._closed

    @property
    def num_pending(self) -> int:
        return self._pending

    def gauges(self) -> dict[str, float]:
        """The engine's gauges as of its last message (see AsyncLLM.gauges)."""
        return self._gauges

    def _start(self) -> None:
        if self._loop is None:
            # the pipe is read by the event loop itself when it has data (no reader thread: a thread would take
            # the interpreter lock from the loop between every message)
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self.conn.fileno(), self._read_ready)

    async def submit(self, prompt: Any, params: SamplingParams) -> RequestStream:
        """As AsyncLLM.submit: the request's Delta iterator once the engine admitted it."""
        self._start()
        if self._closed:
            raise EngineStoppedError("the engine process is gone")
        key = next(self._keys)
        detok = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, params.stop)
        stream = _ClientStream(key, self._loop.create_future(), detok)
        self._streams[key] = stream
        self._pending += 1
        try:
            self._send(("add", key, prompt, params))
            await stream.admitted
        except BaseException:  # refused, or the caller was cancelled while waiting: the engine drops it
            self.abort_stream(stream)
            raise
        return RequestStream(self, stream)

    def abort_stream(self, stream: _ClientStream) -> None:
        """Called by the RequestStream: drop the request (the engine frees its KV)."""
        if stream.open:
            self._end(stream)
            try:
                self._send(("abort", stream.key))
            except (OSError, ValueError, RuntimeError):  # the engine is gone: nothing to free there
                pass

    def _end(self, stream: _ClientStream) -> None:
        if stream.open:
            stream.open = False
            self._pending -= 1
            self._streams.pop(stream.key, None)

    def _send(self, msg: tuple) -> None:
        if self._closed:
            raise EngineStoppedError("the engine process is gone")
        with self._send_lock:
            self.conn.send(msg)

    def _read_ready(self) -> None:
        """On the event loop: every message the pipe holds now; the engine's end closed fails the streams."""
        try:
            while self.conn.poll():
                self._dispatch(self.conn.recv())
        except (EOFError, OSError):
            self._loop.remove_reader(self.conn.fileno())
            self._fail_all()

    def _dispatch(self, msg: tuple) -> None:
        _, items, self._gauges = msg
        for key, item in items:
            stream = self._streams.get(key)
            if stream is None:  # aborted here meanwhile
                continue
            if item is None:
                if not stream.admitted.done():
                    stream.admitted.set_result(None)
            elif isinstance(item, BaseException):
                self._end(stream)
                if not stream.admitted.done():
                    stream.admitted.set_exception(item)
                else:
                    stream.out.put_nowait(item)
            else:
                item = Delta.from_fields(item)
                self._text(stream, item)
                if item.finished:
                    self._end(stream)
                stream.out.put_nowait(item)

    def _text(self, stream: _ClientStream, d: Delta) -> None:
        """Fill ``d.text`` from the request's tokens (what AsyncLLM's loop thread does for a local consumer)."""
        stream.token_ids += d.token_ids
        if stream.detok is not None:
            d.text = stream.detok.delta_text(d.token_ids, finished=d.finished, final_text=d.final_text,
                                             output_ids=stream.token_ids)

    def _fail_all(self) -> None:
        self._closed = True
        for stream in list(self._streams.values()):
            self._end(stream)
            exc = EngineStoppedError("the engine process is gone")
            if not stream.admitted.done():
                stream.admitted.set_exception(exc)
            else:
                stream.out.put_nowait(exc)
