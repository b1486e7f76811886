"""The OpenAI-compatible HTTP app: /v1/completions and /v1/chat/completions (whole or streamed as server-sent events in
OpenAI's chunk format), /v1/models, /health and /metrics (Prometheus), on an AsyncLLM. Refused requests get OpenAI's error body; a
disconnecting client aborts its requests, freeing their KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from compile_attn.engine.serving.async_engine import AsyncLLM, Delta, EngineOverloadedError, EngineStoppedError, RequestStream
from compile_attn.engine.serving.engine_pipe import EngineClient
from compile_attn.engine.requests.errors import InvalidRequestError
from compile_attn.engine.llm import sample_seed
from compile_attn.server import logprobs_format
from compile_attn.server.metrics import CONTENT_TYPE_LATEST, SampleTimer, ServerMetrics
from compile_attn.server.protocol import APIError, Parsed, parse
from compile_attn.server.sse import ChunkFormat


def create_app(engine: AsyncLLM | EngineClient, model_name: str) -> FastAPI:
    """The app serving ``engine`` under ``model_name`` (what clients pass as ``model``): an AsyncLLM in this
    process, or an EngineClient of one in another process (``compile_attn.server.frontend``)."""
    app = FastAPI(title="compile_attn")
    tokenizer, max_context = engine.tokenizer, engine.max_context
    metrics = ServerMetrics(engine, model_name)
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.alive
        return JSONResponse({"status": "ok" if ok else "stopped"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                             "owned_by": "compile_attn", "max_model_len": max_context}]}

    async def handle(request: Request, chat: bool) -> Any:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(f"the request body is not valid JSON: {exc}") from None
        req = parse(body, chat=chat, tokenizer=tokenizer, model_name=model_name, max_context=max_context)
        start = time.perf_counter()
        streams = await _submit_all(engine, req)
        metrics.prompt_tokens.inc(len(req.prompt_ids))
        timers = [metrics.timer(start) for _ in streams]
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if req.stream:
            return StreamingResponse(_sse(streams, timers, req, rid, created, model_name, chat, tokenizer),
                                     media_type="text/event-stream")
        return await _whole(streams, timers, req, rid, created, model_name, chat, tokenizer)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    return app


async def _submit_all(engine: AsyncLLM | EngineClient, req: Parsed) -> list[RequestStream]:
    """Submit the request's ``n`` samples (seeded as LLM.generate seeds them); on any refusal abort those taken."""
    streams: list[RequestStream] = []
    try:
        for k in range(req.n):
            seed = req.params.seed if req.params.seed is None else sample_seed(req.params.seed, k)
            streams.append(await engine.submit(req.prompt_ids, replace(req.params, seed=seed)))
    except BaseException as exc:
        for s in streams:
            s.abort()
        if isinstance(exc, EngineOverloadedError):
            raise APIError(str(exc), status=503, type="server_busy") from None
        if isinstance(exc, EngineStoppedError):
            raise APIError(str(exc), status=503, type="server_error") from None
        if isinstance(exc, InvalidRequestError):
            field = getattr(exc, "param", None) or ("max_tokens" if "max_new_tokens" in str(exc) else "prompt")
            raise APIError(str(exc), field) from None
        raise
    return streams


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _choice(chat: bool, index: int, text: str, finish: str | None, *, delta: bool,
            logprobs: dict | None = None, token_ids: list[int] | None = None) -> dict[str, Any]:
    if not chat:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    else:
        key = "delta" if delta else "message"
        msg = {"role": "assistant", "content": text} if not delta or text else {}
        choice = {"index": index, key: msg, "logprobs": logprobs, "finish_reason": finish}
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
                 model: str, chat: bool, tokenizer: Any) -> dict:
    async def collect(s: RequestStream, timer: SampleTimer) -> tuple[str, Delta, dict | None, list[int]]:
        text, last, ids = "", None, []
        fmt = _LogprobsFormatter(chat, tokenizer, req.params.logprobs)
        async for d in s:
            timer(d)
            text, last = text + d.text, d
            ids += d.token_ids
            fmt(d)
        return text, last, logprobs_format.merge(chat, fmt.parts), ids

    results = await _gather_or_abort([collect(s, t) for s, t in zip(streams, timers)], streams)
    choices = [_choice(chat, k, text, last.finish_reason, delta=False, logprobs=lp,
                       token_ids=ids if req.return_token_ids else None)
               for k, (text, last, lp, ids) in enumerate(results)]
    prompt = results[0][1].num_prompt_tokens
    usage = _usage(prompt, sum(r[1].num_output_tokens for r in results))
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
    """``(k, delta)`` of every sample as each arrives; one sample is read directly (no task or queue per token)."""
    if len(samples) == 1:
        async for d in samples[0]:
            yield 0, d
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, s: AsyncIterator[Delta]) -> None:
        async for d in s:
            await merged.put((k, d))
        await merged.put((k, None))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(samples)]
    try:
        open_ = len(samples)
        while open_:
            k, d = await merged.get()
            if d is None:
                open_ -= 1
                continue
            yield k, d
        for t in tasks:
            t.result()  # re-raise a sample's failure
    finally:
        for t in tasks:
            t.cancel()


async def _sse(streams: list[RequestStream], timers: list[SampleTimer], req: Parsed, rid: str, created: int,
               model: str, chat: bool, tokenizer: Any) -> AsyncIterator[str]:
    """Server-sent events: one chunk per Delta of any sample, the usage chunk if asked, then ``[DONE]``."""
    fmt = ChunkFormat(rid, created, model, chat=chat, include_usage=req.include_usage)
    try:
        if chat:
            yield fmt.chunk([{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for k in range(req.n)])
        prompt, outputs = 0, [0] * req.n
        formats = [_LogprobsFormatter(chat, tokenizer, req.params.logprobs) for _ in range(req.n)]
        async with contextlib.aclosing(_interleave(streams)) as deltas:  # closed (its tasks cancelled) on any exit
            async for k, d in deltas:
                timers[k](d)
                prompt, outputs[k] = d.num_prompt_tokens, d.num_output_tokens
                lp = formats[k](d)
                ids = d.token_ids if req.return_token_ids else None
                if d.text or d.finished or lp or ids:
                    yield fmt.delta(k, d.text, d.finish_reason, lp, ids)
        if req.include_usage:
            yield fmt.chunk([], _usage(prompt, sum(outputs)))
        yield "data: [DONE]\n\n"
    finally:
        for s in streams:
            s.abort()
