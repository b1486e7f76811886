"""The OpenAI-compatible HTTP app: /v1/completions and /v1/chat/completions (whole or streamed as server-sent events in
OpenAI's chunk format), /v1/models, vLLM's /tokenize and /detokenize, /version, /health and /metrics (Prometheus), on
an AsyncLLM. Refused requests get OpenAI's error body; a disconnecting client aborts its requests, freeing their KV.
Each finished request is logged at INFO (its id, tokens, latency and finish reasons). The request bodies are parsed
by ``protocol`` and described for /openapi.json and /docs by ``schemas``' pydantic models.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse

from compile_attn.engine.serving.async_engine import AsyncLLM

from compile_attn.engine.serving.streams import (Delta, EngineOverloadedError, EngineStoppedError,
                                                 RequestStream)
from compile_attn.engine.serving.engine_pipe import EngineClient
from compile_attn.engine.requests.errors import InvalidRequestError, MessageTooLargeError
from compile_attn.engine.requests.token_writer import sample_seed
from compile_attn.version import __version__
from compile_attn.server import logprobs_format, request_body, schemas
from compile_attn.server.http_guards import add_guards
from compile_attn.server.metrics import CONTENT_TYPE_LATEST, SampleTimer, ServerMetrics
from compile_attn.server.options import ServerOptions
from compile_attn.server.protocol import APIError, Parsed, parse, parse_detokenize, parse_tokenize
from compile_attn.server.shutdown import Drain, ServerShuttingDownError
from compile_attn.server.sse import ChunkFormat

logger = logging.getLogger(__name__)


def create_app(engine: AsyncLLM | EngineClient, model_name: str, options: ServerOptions | None = None) -> FastAPI:
    """The app serving ``engine`` under ``model_name`` (what clients pass as ``model``): an AsyncLLM in this
    process, or an EngineClient of one in another process (``compile_attn.server.frontend``); ``options`` (default
    ``ServerOptions()``) sets its request size limit, CORS origins and API key."""
    options = ServerOptions() if options is None else options
    app = FastAPI(title="compile_attn")
    tokenizer, max_context = engine.tokenizer, engine.max_context
    kv_cache_dtype = getattr(engine, "kv_cache_dtype", "auto")  # "auto" (the model's), "fp8_e4m3" or "fp8_e5m2"
    metrics = ServerMetrics(engine, model_name)
    app.state.metrics = metrics
    drain = app.state.drain = Drain()  # the open requests, for a graceful shutdown (GracefulServer)

    add_guards(app, options)

    @app.get("/health")
    async def health() -> JSONResponse:
        status = "stopped" if not engine.alive else "shutting down" if drain.draining else "ok"
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", response_model=schemas.VersionResponse)
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                             "owned_by": "compile_attn", "max_model_len": max_context,
                                             "kv_cache_dtype": kv_cache_dtype}]}

    def parse_body(raw: bytes, chat: bool) -> Parsed:
        return parse(request_body.loads(raw), chat=chat, tokenizer=tokenizer, model_name=model_name,
                     max_context=max_context)

    async def read_json(request: Request) -> tuple[bytes, int]:
        request_body.check_json_media_type(request)
        raw = await request_body.read_limited(request, options.max_request_bytes)
        return raw, len(raw)

    async def handle(request: Request, chat: bool) -> Any:
        received = time.perf_counter()
        raw, size = await read_json(request)
        req = await request_body.off_loop_if_large(size, parse_body, raw, chat)
        if drain.draining:
            raise _shutting_down()
        start = time.perf_counter()
        streams = await _submit_all(engine, req)
        drain.track(streams)
        metrics.prompt_tokens.inc(sum(map(len, req.prompts)))
        timers = [metrics.timer(start) for _ in streams]
        rid = ("chatcmpl-" if chat else "cmpl-") + (req.request_id or uuid.uuid4().hex)
        created = int(time.time())
        done = _Finished(rid, req, received)
        if req.stream:
            return StreamingResponse(_sse(streams, timers, req, rid, created, model_name, chat, tokenizer, done),
                                     media_type="text/event-stream")
        try:
            return await _whole(streams, timers, req, rid, created, model_name, chat, tokenizer, done)
        except EngineStoppedError as exc:  # ended by a shutdown, or the engine is gone
            raise _shutting_down() if isinstance(exc, ServerShuttingDownError) else _engine_gone(exc) from None
        finally:
            done.log()

    @app.post("/v1/completions", openapi_extra=schemas.request_body(schemas.CompletionRequest))
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=schemas.request_body(schemas.ChatCompletionRequest))
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    vocab = None if tokenizer is None else len(tokenizer)

    @app.post("/tokenize", response_model=schemas.TokenizeResponse, response_model_exclude_none=True,
              openapi_extra=schemas.request_body(schemas.TokenizeCompletionRequest, schemas.TokenizeChatRequest))
    async def tokenize(request: Request) -> dict:
        raw, size = await read_json(request)
        ids, strs = await request_body.off_loop_if_large(
            size, lambda: parse_tokenize(request_body.loads(raw), tokenizer=tokenizer, model_name=model_name))
        out: dict[str, Any] = {"count": len(ids), "max_model_len": max_context, "tokens": ids}
        if strs:
            out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize", response_model=schemas.DetokenizeResponse,
              openapi_extra=schemas.request_body(schemas.DetokenizeRequest))
    async def detokenize(request: Request) -> dict:
        raw, size = await read_json(request)
        ids = await request_body.off_loop_if_large(
            size, lambda: parse_detokenize(request_body.loads(raw), model_name=model_name, vocab_size=vocab))
        if tokenizer is None:
            raise APIError("this model has no tokenizer")
        return {"prompt": tokenizer.decode(ids)}

    def openapi() -> dict[str, Any]:
        """FastAPI's OpenAPI document with the request and response models' schemas in its components (the
        routes' bodies refer to them: they are parsed by ``protocol``, not by FastAPI)."""
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=__version__, routes=app.routes,
                              description="An OpenAI-compatible server (with vLLM's extensions) on compile_attn's "
                                          "engine. Every error status has OpenAI's body (ErrorResponse).")
            doc.setdefault("components", {}).setdefault("schemas", {}).update(schemas.component_schemas())
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


class _Finished:
    """One HTTP request's log line, written once when it is done (answered, streamed to the end, or dropped): its id,
    prompt and output tokens, seconds from arrival, and each choice's finish reason ("abort" where none came)."""

    def __init__(self, rid: str, req: Parsed, received: float) -> None:
        self.rid, self.received = rid, received
        self.prompt_tokens = sum(map(len, req.prompts))
        self.outputs = [0] * req.num_choices
        self.reasons: list[str | None] = [None] * req.num_choices
        self.logged = False

    def log(self) -> None:
        if self.logged:
            return
        self.logged = True
        if logger.isEnabledFor(logging.INFO):
            reasons = ",".join(r or "abort" for r in self.reasons)
            logger.info("%s: %d prompt + %d output tokens in %.3f s, finish %s", self.rid, self.prompt_tokens,
                        sum(self.outputs), time.perf_counter() - self.received, reasons)


async def _submit_all(engine: AsyncLLM | EngineClient, req: Parsed) -> list[RequestStream]:
    """Submit the request's ``n`` samples of each prompt (choice ``i * n + k``: sample ``k`` of prompt ``i``, seeded
    as LLM.generate seeds them); on any refusal abort those taken."""
    streams: list[RequestStream] = []
    try:
        samples = [req.params if req.params.seed is None else replace(req.params, seed=sample_seed(req.params.seed, k))
                   for k in range(req.n)]
        for prompt in req.prompts:
            for params in samples:
                streams.append(await engine.submit(prompt, params))
    except BaseException as exc:
        for s in streams:
            s.abort()
        if isinstance(exc, EngineOverloadedError):
            raise APIError(str(exc), status=503, type="server_busy") from None
        if isinstance(exc, EngineStoppedError):
            raise _engine_gone(exc) from None
        if isinstance(exc, MessageTooLargeError):
            raise APIError(str(exc), "prompt", status=413) from None
        if isinstance(exc, InvalidRequestError):
            field = getattr(exc, "param", None) or ("max_tokens" if "max_new_tokens" in str(exc) else "prompt")
            raise APIError(str(exc), field) from None
        raise
    return streams


def _shutting_down() -> APIError:
    return APIError("the server is shutting down; retry against another replica or after it restarts", status=503,
                    type="server_error")


def _engine_gone(exc: BaseException) -> APIError:
    return APIError(f"the engine is not serving: {exc}", status=503, type="server_error")


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _choice(chat: bool, index: int, text: str, finish: str | None, *, delta: bool,
            logprobs: dict | None = None, token_ids: list[int] | None = None,
            stop_reason: int | str | None = None) -> dict[str, Any]:
    if not chat:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": stop_reason}
    else:
        key = "delta" if delta else "message"
        msg = {"role": "assistant", "content": text} if not delta or text else {}
        choice = {"index": index, key: msg, "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": stop_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


class _LogprobsFormatter:
    """One sample's Deltas' logprobs in OpenAI's form (completions' text offsets run on across Deltas)."""

    def __init__(self, chat: bool, tokenizer: Any, num_top: int | None) -> None:
        self.chat, self.tokenizer, self.num_top, self.offset = chat, tokenizer, num_top, 0
        self.parts: list[dict] = []

    def __call__(self, d: Delta) -> dict | None:
        if d.logprobs is None or self.num_top is None:
            return None
        if self.chat:
            part = logprobs_format.chat_logprobs(d.logprobs, d.token_ids, self.tokenizer, self.num_top)
        else:
            part = logprobs_format.completion_logprobs(d.logprobs, d.token_ids, self.tokenizer, self.num_top,
                                                       self.offset)
            self.offset += sum(map(len, part["tokens"]))
        self.parts.append(part)
        return part


async def _whole(streams: list[RequestStream], timers: list[SampleTimer], req: Parsed, rid: str, created: int,
                 model: str, chat: bool, tokenizer: Any, done: _Finished) -> dict:
    async def collect(j: int, s: RequestStream, timer: SampleTimer) -> tuple[str, Delta, dict | None, list[int]]:
        text, last, ids = "", None, []
        fmt = _LogprobsFormatter(chat, tokenizer, req.params.logprobs)
        async for d in s:
            timer(d)
            text, last = text + d.text, d
            ids += d.token_ids
            fmt(d)
            done.outputs[j] = d.num_output_tokens
        assert last is not None  # a stream ends with its finished Delta
        done.reasons[j] = last.finish_reason
        return text, last, logprobs_format.merge(chat, fmt.parts), ids

    try:
        results = await _gather_or_abort([collect(j, s, t) for j, (s, t) in enumerate(zip(streams, timers))],
                                         streams)
    finally:
        for timer in timers:
            timer.abandon()
    echo = req.echo_texts
    choices = [_choice(chat, j, text if echo is None else echo[j // req.n] + text, last.finish_reason, delta=False,
                       logprobs=lp, token_ids=ids if req.return_token_ids else None, stop_reason=last.stop_reason)
               for j, (text, last, lp, ids) in enumerate(results)]
    usage = _usage(done.prompt_tokens, sum(r[1].num_output_tokens for r in results))
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage}


async def _gather_or_abort(coros: list, streams: list[RequestStream]) -> list:
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:  # a cancelled handler (client gone): stop every sample, which aborts its request
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def _interleave(samples: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """``(k, delta)`` of every sample as each arrives; one sample is read directly (no task or queue per token). A
    sample's failure is raised here (the other samples are then dropped)."""
    if len(samples) == 1:
        async for d in samples[0]:
            yield 0, d
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, s: AsyncIterator[Delta]) -> None:
        try:
            async for d in s:
                await merged.put((k, d))
            await merged.put((k, None))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await merged.put((k, exc))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(samples)]
    try:
        open_ = len(samples)
        while open_:
            k, d = await merged.get()
            if d is None:
                open_ -= 1
                continue
            if isinstance(d, BaseException):
                raise d
            yield k, d
    finally:
        for t in tasks:
            t.cancel()


async def _sse(streams: list[RequestStream], timers: list[SampleTimer], req: Parsed, rid: str, created: int,
               model: str, chat: bool, tokenizer: Any, done: _Finished) -> AsyncIterator[str]:
    """Server-sent events: one chunk per Delta of any sample, the usage chunk if asked, then ``[DONE]``. A shutdown
    that ends the request gives each unfinished sample a last chunk with finish_reason "abort"; a failure after the
    first chunk (the engine gone) an error event; both then end with ``[DONE]``. With echo, each choice's first
    chunk is its prompt's text."""
    fmt = ChunkFormat(rid, created, model, chat=chat, include_usage=req.include_usage)
    num = req.num_choices
    finished = [False] * num
    try:
        if chat:
            yield fmt.chunk([{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None, "stop_reason": None} for k in range(num)])
        if req.echo_texts is not None:
            for k in range(num):
                yield fmt.delta(k, req.echo_texts[k // req.n], None)
        outputs = done.outputs
        formats = [_LogprobsFormatter(chat, tokenizer, req.params.logprobs) for _ in range(num)]
        try:
            async with contextlib.aclosing(_interleave(streams)) as deltas:  # closed (tasks cancelled) on any exit
                async for k, d in deltas:
                    timers[k](d)
                    outputs[k], finished[k] = d.num_output_tokens, d.finished
                    lp = formats[k](d)
                    ids = d.token_ids if req.return_token_ids else None
                    if d.finished:
                        done.reasons[k] = d.finish_reason
                        yield fmt.delta(k, d.text, d.finish_reason, lp, ids, d.stop_reason)
                    elif d.text or lp or ids:
                        yield fmt.delta(k, d.text, None, lp, ids)
        except ServerShuttingDownError:
            for k in range(num):
                if not finished[k]:
                    yield fmt.delta(k, "", "abort")
        except Exception as exc:  # noqa: BLE001 - the status line is sent: the error goes in the stream
            if not isinstance(exc, EngineStoppedError):
                logger.exception("a streamed request failed")
            err = _engine_gone(exc) if isinstance(exc, EngineStoppedError) else APIError(
                f"the request failed: {type(exc).__name__}", status=500, type="server_error")
            yield f"data: {json.dumps(err.body())}\n\n"
            yield "data: [DONE]\n\n"
            return
        if req.include_usage:
            yield fmt.chunk([], _usage(done.prompt_tokens, sum(outputs)))
        yield "data: [DONE]\n\n"
    finally:
        for s in streams:
            s.abort()
        for timer in timers:
            timer.abandon()
        done.log()
