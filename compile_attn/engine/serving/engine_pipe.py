"""An AsyncLLM served to another process: ``PipeBridge`` on the engine's side, ``EngineClient`` (the AsyncLLM's
consumer interface: ``submit``, ``alive``, ``num_pending``, ``tokenizer``, ``max_context``, ``gauges``) on the other.

Why: a consumer in the engine's process (an HTTP server formatting a chunk per token, say) competes with the step
loop for the interpreter lock, and at a few hundred streams its per-token work outgrows the GPU step it must hide
behind. Behind the pipe the engine process does only the steps: one message per step carries every request's new
token ids (and the engine's gauges), and the consumer's process detokenises and formats them.

Transport (``compile_attn.engine.serving.channel``): a ZeroMQ PAIR socket over IPC carries whole pickled messages (never
half of one, whatever their size; a send never blocks and never fails under load: ZeroMQ queues), and a lifeline
(a socket pair nothing is written to) tells either side when the other is gone. Messages: to the engine
``("add", key, prompt, params)``, ``("abort", key)`` and ``("ack", n)`` (the client has handled n more messages);
from it ``("out", [(key, item), ...], gauges)`` where an item is None (admitted), an exception (refused or failed)
or ``Delta.fields()`` (token ids, no text: the client's IncrementalDetokenizer makes it).

A client that falls behind never stalls the steps: while ``max_unacked`` messages are sent and not yet handled, a
step's items wait in the bridge, each request's tokens merged into one item, and go out in one message once the
client has caught up (or the loop runs out of work). The client then gets fewer, longer items, which costs it less
per token, so it catches up. When the loop runs out of work the bridge also sends the gauges if they changed, so a
client's view of the engine settles once its requests end (or are aborted).

Either side going away ends what it served: the engine aborts the client's requests (their KV is freed), the client
fails its streams with EngineStoppedError.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import threading
from typing import Any

from compile_attn.engine.serving.async_engine import AsyncLLM

from compile_attn.engine.serving.streams import (Delta, EngineStoppedError, RequestStream, StreamState,
                                                 merge_fields)
from compile_attn.engine.requests.errors import MessageTooLargeError
from compile_attn.engine.requests.sampling_params import SamplingParams
from compile_attn.engine.serving.channel import Channel, ChannelAddress, open_channel
from compile_attn.engine.serving.detokenizer import IncrementalDetokenizer, detokenizer_for

logger = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 32 << 20  # one request's message to the engine (its prompt and parameters), pickled


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception type may fail to pickle
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class PipeBridge:
    """The engine's side: the AsyncLLM's loop reads the client's commands between steps (``AsyncLLM.attach``) and
    sends each step's items (``deliver``) as one message. ``address`` is what the client connects with (it pickles
    into a spawned process's arguments). ``close()`` (or the client going away) aborts what is left."""

    takes_fields = True  # the loop hands it Delta.fields() tuples, not Deltas: the client detokenises
    max_unacked = 8  # messages sent and not yet handled by the client past which items wait here (merged)

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self._channel, self.address = open_channel(gauges=engine.gauges())
        self._streams: dict[int, StreamState] = {}
        self._held: list[list] = []  # [key, item] waiting for the client, in order
        self._held_tokens: dict[int, int] = {}  # key -> index in _held of its last item when that is a token tuple
        self._unacked = 0
        self._sent_gauges: dict[str, float] = {}
        self.num_held = 0  # deliveries that waited (a measure of how far the client lags)
        self.closed = False
        engine.attach(self)

    # ------------------------------------------------------------------ the loop's port (AsyncLLM.attach)
    def waitables(self) -> list:
        return self._channel.waitables()

    def readable(self) -> bool:
        return self._channel.readable()

    def pump(self) -> bool:
        """On the loop thread: handle every command that arrived; False once the client is gone."""
        for msg in self._channel.receive():
            self._on_message(msg)
        return self._channel.peer_alive()

    def on_idle(self) -> None:
        """On the loop thread when it has no work: send what waits, whatever the client's backlog, or else the
        gauges if they changed since the client last had them."""
        gauges = self.engine.gauges()
        if self._held or gauges != self._sent_gauges:
            self._send_held(gauges)

    def on_close(self) -> None:
        """On the loop thread once the client is gone or the bridge detached: abort its requests, close the
        channel."""
        for stream in list(self._streams.values()):
            stream.gone = True
            self.engine.abort_stream(stream)
        self._streams.clear()
        self.release()

    def release(self) -> None:
        """Close the channel (the client sees the engine gone); the requests are left to the engine."""
        self._held.clear()
        self._held_tokens.clear()
        self._channel.close()
        self.closed = True

    # ------------------------------------------------------------------ the loop's sink
    def deliver(self, items: list[tuple[StreamState, Any]]) -> None:
        """Called on the loop thread: the items of one step (or one admission), sent as one message with any that
        waited before them, or kept (merged per request) while the client lags."""
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
        if self._unacked >= self.max_unacked:
            self.num_held += 1
            return
        self._send_held()

    def _send_held(self, gauges: dict[str, float] | None = None) -> None:
        gauges = self.engine.gauges() if gauges is None else gauges
        out = [(key, item) for key, item in self._held]
        if self._channel.send(("out", out, gauges)):
            self._held.clear()
            self._held_tokens.clear()
            self._unacked += 1
            self._sent_gauges = gauges
        # else: no client connected yet; what waits goes with the next message

    def _on_message(self, msg: tuple) -> None:
        """On the loop thread: one command of the client."""
        kind = msg[0]
        if kind == "ack":
            self._unacked = max(0, self._unacked - msg[1])
        elif kind == "add":
            _, key, prompt, params = msg
            stream = StreamState(self, key=key)
            self._streams[key] = stream
            self.engine.add_stream(prompt, params, stream)
        elif kind == "abort":
            stream = self._streams.pop(msg[1], None)
            if stream is not None:
                self.engine.abort_stream(stream)
        else:
            logger.warning("engine pipe: unknown message %r", kind)

    def close(self) -> None:
        """Stop serving the client (from any thread): its requests are aborted, it sees the engine stopped."""
        self.engine.detach(self)


class _ClientStream:
    """One request on the client's side: its queue of Deltas, its admission, its text so far."""

    def __init__(self, key: int, admitted: asyncio.Future, detok: IncrementalDetokenizer | None) -> None:
        self.key, self.admitted, self.detok = key, admitted, detok
        self.out: asyncio.Queue = asyncio.Queue()
        self.token_ids: list[int] = []
        self.open = True  # counted in num_pending


class EngineClient:
    """The AsyncLLM interface in another process than the engine, connected to a PipeBridge's ``address``. Needs
    the engine's ``tokenizer`` (None: no text) and ``max_context``; the engine refuses requests past its
    ``max_pending`` (EngineOverloadedError from ``submit``). Used from one asyncio event loop (the first
    ``submit``'s)."""

    def __init__(self, address: ChannelAddress, *, tokenizer: Any, max_context: int,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, kv_cache_dtype: str = "auto") -> None:
        self.tokenizer, self.max_context, self.max_message_bytes = tokenizer, max_context, max_message_bytes
        self.kv_cache_dtype = kv_cache_dtype  # the engine's, for /v1/models
        self._channel: Channel = address.connect()
        self._streams: dict[int, _ClientStream] = {}
        self._keys = itertools.count()
        self._pending = 0
        self._gauges: dict[str, float] = dict(address.gauges)  # the engine's at start: capacity known at once
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._send_lock = threading.Lock()  # a RequestStream dropped on another thread aborts from there

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
            # read by the event loop itself when data arrives (no reader thread: a thread would take the
            # interpreter lock from the loop between every message)
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._channel.fileno(), self._read_ready)
            self._loop.add_reader(self._channel.lifeline_fileno(), self._lifeline_ready)
            self._read_ready()  # what arrived before the loop watched

    async def submit(self, prompt: Any, params: SamplingParams) -> RequestStream:
        """As AsyncLLM.submit: the request's Delta iterator once the engine admitted it. MessageTooLargeError when
        its message would exceed ``max_message_bytes``."""
        self._start()
        if self._closed:
            raise EngineStoppedError("the engine process is gone")
        key = next(self._keys)
        data = pickle.dumps(("add", key, prompt, params), protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > self.max_message_bytes:
            raise MessageTooLargeError(f"the request takes {len(data)} bytes to send to the engine, more than the "
                                       f"limit of {self.max_message_bytes}; send a shorter prompt or fewer stop "
                                       f"strings")
        detok = None if self.tokenizer is None else detokenizer_for(self.tokenizer, params)
        stream = _ClientStream(key, self._loop.create_future(), detok)
        self._streams[key] = stream
        self._pending += 1
        try:
            if not self._send_bytes(data):
                raise EngineStoppedError("the engine process is gone")
            await stream.admitted
        except BaseException:  # refused, or the caller was cancelled while waiting: the engine drops it
            self.abort_stream(stream)
            raise
        return RequestStream(self, stream)

    def abort_stream(self, stream: _ClientStream) -> None:
        """Called by the RequestStream: drop the request (the engine frees its KV)."""
        if stream.open:
            self._end(stream)
            if not self._closed:
                self._send_bytes(pickle.dumps(("abort", stream.key)))

    def close(self) -> None:
        """Disconnect from the engine (it aborts this client's requests); the streams fail with
        EngineStoppedError."""
        if not self._closed:
            self._fail_all()

    def _end(self, stream: _ClientStream) -> None:
        if stream.open:
            stream.open = False
            self._pending -= 1
            self._streams.pop(stream.key, None)

    def _send_bytes(self, data: bytes) -> bool:
        """Send one message; False if the engine's side is gone."""
        if self._closed:
            return False
        with self._send_lock:
            sent = self._channel.send_bytes(data)
        # a send may take the socket's read signal with it: look for messages that arrived meanwhile
        if self._loop is not None and self._channel.readable():
            self._loop.call_soon(self._read_ready)
        return sent

    def _read_ready(self) -> None:
        """On the event loop: every message that arrived; then one acknowledgement for all of them."""
        if self._closed:
            return
        msgs = self._channel.receive()
        for msg in msgs:
            self._dispatch(msg)
        if msgs and not self._closed:
            self._send_bytes(pickle.dumps(("ack", len(msgs))))

    def _lifeline_ready(self) -> None:
        """On the event loop: the engine's side closed (its process died, or the bridge was closed)."""
        if not self._channel.peer_alive():
            self._read_ready()  # what it sent before going
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
                                             output_ids=stream.token_ids, finish_reason=d.finish_reason)

    def _fail_all(self) -> None:
        self._closed = True
        if self._loop is not None:
            self._loop.remove_reader(self._channel.fileno())
            self._loop.remove_reader(self._channel.lifeline_fileno())
        self._channel.close()
        for stream in list(self._streams.values()):
            self._end(stream)
            exc = EngineStoppedError("the engine process is gone")
            if not stream.admitted.done():
                stream.admitted.set_exception(exc)
            else:
                stream.out.put_nowait(exc)
