"""What an AsyncLLM hands its consumers, and how: each request's ``Delta``s, the consumer's ``RequestStream`` over them,
the loop thread's per-request ``StreamState`` and the sinks it delivers to (an event loop's ``LoopSink``, or a
``Port`` to another process), and the two errors a consumer meets (overloaded, stopped). No engine logic here: the
step loop is ``async_engine.AsyncLLM``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from compile_attn.engine.serving.detokenizer import IncrementalDetokenizer
from compile_attn.engine.requests.request import Request
from compile_attn.errors import CompileAttnError


class EngineOverloadedError(CompileAttnError, RuntimeError):
    """More requests are unfinished than the AsyncLLM's ``max_pending``; retry later (an HTTP server answers 503
    with Retry-After)."""


class EngineStoppedError(CompileAttnError, RuntimeError):
    """The AsyncLLM was shut down (or its step loop failed), so it takes no more requests."""


@dataclass
class Delta:
    """What one request produced since the last Delta: its new token ids and text, and, on the last one, why it
    finished. ``num_prompt_tokens`` / ``num_output_tokens`` count the whole request so far. ``logprobs``: one
    ``dict[int, Logprob]`` per new token when the request asked for them (``SamplingParams.logprobs``) and the
    step records them in ``Request.logprobs``; else None."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list | None = None
    final_text: str | None = None  # on the last Delta: the request's whole text (None: not known to the engine)
    stop_reason: int | str | None = None  # on the last Delta: the stop token id or stop string that ended it

    @classmethod
    def from_fields(cls, fields: tuple, text: str = "") -> Delta:
        """The Delta of ``fields`` (every field but ``text``, in order: what a pipe carries, see ``fields``)."""
        return cls(fields[0], text, *fields[1:])

    def fields(self) -> tuple:
        """Every field but ``text``, as a tuple (pickles several times faster than the dataclass)."""
        return (self.token_ids, self.finished, self.finish_reason, self.num_prompt_tokens, self.num_output_tokens,
                self.logprobs, self.final_text, self.stop_reason)


class Port(Protocol):
    """A consumer in another process, served by the loop between steps (``AsyncLLM.attach``; see ``engine_pipe``).
    Every method runs on the loop thread."""

    def waitables(self) -> list:
        """What an idle loop waits on (file descriptors or objects with ``fileno``)."""

    def readable(self) -> bool:
        """Whether a command waits that the waitables may not signal again (an edge-triggered socket)."""

    def pump(self) -> bool:
        """Handle every command that arrived; False once the peer is gone (the loop drops the port)."""

    def on_idle(self) -> None:
        """The loop ran out of work and is about to wait: send what was held back."""

    def on_close(self) -> None:
        """The peer is gone or the port was detached: abort its requests, release its channel."""

    def release(self) -> None:
        """Release the channel only (the loop has ended)."""


class LoopSink:
    """Where a stream's items go: an asyncio event loop (its consumer's), one ``call_soon_threadsafe`` per batch of
    items (``deliver`` raises RuntimeError once that loop has closed)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def deliver(self, items: list[tuple[StreamState, Any]]) -> None:
        self.loop.call_soon_threadsafe(_deliver, [(stream.out, item) for stream, item in items])


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    """On a consumer's event loop: one step's items into their queues (one wake-up of the loop per step)."""
    for out, item in items:
        out.put_nowait(item)


class StreamState:
    """One request's state on the loop thread: what was sent to its consumer, and where to send more (``sink``:
    a LoopSink, or another process's pipe). ``detok`` is None where the consumer detokenises itself (a pipe) or
    there is no tokenizer."""

    def __init__(self, sink: Any, out: asyncio.Queue | None = None, key: Any = None) -> None:
        self.sink, self.out, self.key = sink, out, key
        self.req: Request | None = None
        self.sent_tokens = 0
        self.admitted_at = 0.0  # perf_counter() when the loop admitted it
        self.detok: IncrementalDetokenizer | None = None  # the request's streamed text
        self.wants_text = out is not None  # a local consumer: the loop thread detokenises for it
        # the sink takes a Delta's fields as a tuple (``Delta.fields``), the text left to its consumer (a pipe)
        self.as_fields = bool(getattr(sink, "takes_fields", False))
        self.gone = False  # the consumer's event loop is closed: nobody will read more

    def put(self, item: Any) -> None:
        try:
            self.sink.deliver([(self, item)])
        except RuntimeError:  # its event loop has closed
            self.gone = True

    def next_delta(self, *, finished: bool, known: int | None = None) -> Delta | tuple:
        """The request's tokens since the last Delta (``known``: its output tokens read back so far, default
        ``num_output_known``) and the text they made safe to send (see IncrementalDetokenizer); the last Delta
        completes the text to the request's final text. For a sink that takes fields, ``Delta.fields()`` of it
        (no text: its consumer detokenises)."""
        req, stream = self.req, self
        num_prompt = len(req.prompt_ids)
        if known is None:
            known = req.num_output_known
        sent = stream.sent_tokens
        # up to the tokens read back: a step in flight's placeholders are not tokens yet
        new = req.token_ids[num_prompt + sent:num_prompt + known].tolist()
        recorded = req.logprobs  # per output token, when the step computes them
        logprobs = None
        if recorded is not None and req.params.logprobs is not None:
            logprobs = list(recorded[sent: sent + len(new)])
        stream.sent_tokens = sent + len(new)
        reason = (req.finish_reason or "abort") if finished else None
        final = req.text if finished else None
        stop = req.stop_reason if finished else None
        if stream.as_fields:
            return (new, finished, reason, num_prompt, stream.sent_tokens, logprobs, final, stop)
        text = "" if stream.detok is None else stream.detok.delta_text(
            new, finished=finished, final_text=req.text, output_ids=req.output_ids if finished else (),
            finish_reason=reason)
        return Delta(new, text, finished, reason, num_prompt, stream.sent_tokens, logprobs, final, stop)


def merge_fields(a: tuple, b: tuple) -> tuple:
    """Two ``Delta.fields()`` of one request, ``a`` then ``b``, as one: the tokens (and logprobs) of both, the rest
    from ``b``."""
    logprobs = None if a[5] is None and b[5] is None else (a[5] or []) + (b[5] or [])
    return (a[0] + b[0], b[1], b[2], b[3], b[4], logprobs, b[6], b[7])


def merge_deltas(a: Delta, b: Delta) -> Delta:
    """``a`` then ``b`` as one Delta."""
    return Delta.from_fields(merge_fields(a.fields(), b.fields()), a.text + b.text)


def _requeue_first(out: asyncio.Queue, item: Any) -> None:
    """Put ``item`` back at the head of ``out`` (nothing else reads it concurrently: one consumer per stream)."""
    rest = [item]
    while not out.empty():
        rest.append(out.get_nowait())
    for x in rest:
        out.put_nowait(x)


class RequestStream:
    """One submitted request's Deltas (an async iterator). ``abort()`` (or ``aclose()``) before the last Delta
    drops the request and frees its KV; so does a stream dropped unfinished. ``end(exc)`` drops it too and has the
    consumer's next (or pending) ``__anext__`` raise ``exc``."""

    def __init__(self, engine: Any, stream: Any) -> None:  # an AsyncLLM and its StreamState, or an EngineClient's
        self._engine, self._stream = engine, stream
        self.finished = False
        self._ended: BaseException | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        """The next Delta: everything the request produced since the last one taken (a consumer that falls behind
        the steps gets their Deltas merged into one, so it never lags further)."""
        if self._ended is not None:
            raise self._ended
        if self.finished:
            raise StopAsyncIteration
        out = self._stream.out
        item = await out.get()
        if self._ended is not None:  # woken by end()
            raise self._ended
        while isinstance(item, Delta) and not item.finished and not out.empty():
            nxt = out.get_nowait()
            if not isinstance(nxt, Delta):  # an exception after tokens: hand over the tokens, raise it next time
                _requeue_first(out, nxt)
                break
            item = merge_deltas(item, nxt)
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort_stream(self._stream)

    def end(self, exc: BaseException) -> None:
        """Abort the request (if unfinished) and make the consumer's next ``__anext__`` raise ``exc``; call on the
        consumer's event loop."""
        if not self.finished:
            self.abort()
            self._ended = exc
            self._stream.out.put_nowait(None)  # wakes a consumer waiting for its next Delta

    async def aclose(self) -> None:
        self.abort()

    def __del__(self) -> None:
        self.abort()
