"""A POST body from the wire to a Python value, refusing early and cheaply: a media type other than JSON (415), a
body over the size limit (413, from Content-Length before reading or counted while reading a chunked body), JSON
nested deeper than ``MAX_JSON_DEPTH`` or malformed (400). Each refusal is an APIError with OpenAI's error body. A
large body's decoding and parsing run off the event loop (``off_loop_if_large``) so other requests keep being
answered. It knows nothing of the OpenAI fields themselves (``compile_attn.server.protocol``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, TypeVar

from starlette.requests import Request

from compile_attn.server.protocol import APIError

MAX_JSON_DEPTH = 64  # an OpenAI body nests 5 deep (messages, content parts); far deeper is an attack on the parser
OFF_LOOP_BYTES = 64 * 1024  # bodies at least this long are decoded and parsed in a worker thread

_T = TypeVar("_T")
_CONTAINERS = frozenset((dict, list))  # what json.loads nests (exactly these types)


def check_json_media_type(request: Request) -> None:
    """415 unless the Content-Type is ``application/json`` (any parameters, e.g. a charset). A browser page may
    POST ``text/plain`` or a form to any origin without asking (no CORS preflight); refusing those stops a web
    page from making a local server generate."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError(f"the request body must be sent as Content-Type: application/json, got "
                       f"{media_type or 'no Content-Type'!r:.80}; set the header (curl: -H 'Content-Type: "
                       f"application/json')", status=415, code="unsupported_media_type")


def _too_large(size: str, limit: int) -> APIError:
    return APIError(f"the request body is {size} bytes and this server takes at most {limit} (--max-request-bytes); "
                    f"send a shorter prompt", status=413, code="request_too_large")


async def read_limited(request: Request, limit: int) -> bytes:
    """The body, refused with 413 when longer than ``limit`` bytes: from Content-Length before reading anything,
    or, without one (a chunked body), as soon as the bytes read pass the limit (the rest is never kept)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(declared, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"over {limit}", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def nests_deeper(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the parsed JSON ``value`` nests lists and dicts more than ``limit`` deep (a loop, not recursion;
    it stops at the first container past the limit). A container of scalars only, such as a long list of token
    ids, is passed over at C speed."""
    stack = [(value, 1)] if type(value) in _CONTAINERS else []
    while stack:
        container, depth = stack.pop()
        if depth > limit:
            return True
        items = container.values() if type(container) is dict else container
        if not _CONTAINERS.isdisjoint(map(type, items)):
            stack.extend((v, depth + 1) for v in items if type(v) in _CONTAINERS)
    return False


def loads(data: bytes) -> Any:
    """``data`` parsed as JSON, or a 400 APIError saying what is wrong with it (nested more than
    ``MAX_JSON_DEPTH`` deep, malformed, not UTF-8). The depth is only walked for a body with more opening brackets
    than the limit (two byte counts settle almost every real body); far deeper bodies stop the parser itself."""
    too_deep = APIError(f"the request body nests JSON arrays and objects more than {MAX_JSON_DEPTH} deep; an OpenAI "
                        f"request needs a handful of levels")
    try:
        value = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise too_deep from None
    if data.count(b"[") + data.count(b"{") > MAX_JSON_DEPTH and nests_deeper(value):
        raise too_deep
    return value


async def off_loop_if_large(size: int, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` in a worker thread when the body is ``OFF_LOOP_BYTES`` or longer (its JSON parse and tokenising
    then never hold the event loop for long: the tokenizer releases the interpreter lock), else right here (a
    thread hop costs more than a small body's parse)."""
    if size < OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)
