"""What stands between the network and the app's routes: OpenAI's error body on every error status (the app's own
APIError, Starlette's 404 / 405, FastAPI's 422, and any unexpected exception as a logged 500), the API key check on
every route but the open ones (401; ``OPEN_PATHS``) and CORS for the origins ``ServerOptions.allowed_origins`` names (off otherwise). It owns no
route and no request parsing (``compile_attn.server.request_body``, ``compile_attn.server.protocol``)."""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from compile_attn.server.options import ServerOptions
from compile_attn.server.protocol import APIError

logger = logging.getLogger(__name__)
ROUTES = ("POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /tokenize, POST /detokenize, "
          "GET /version, GET /health, GET /metrics, GET /docs, GET /openapi.json")
# What an API key leaves open: liveness, metrics and the version (as vLLM leaves them), and the API's description.
# Everything else needs the key: /v1/* as in vLLM, and /tokenize and /detokenize too (vLLM leaves those open, which
# its security guide lists as a gap: they run the tokenizer and the chat template for anyone).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/docs", "/docs/oauth2-redirect", "/redoc",
                        "/openapi.json"})


def add_guards(app: FastAPI, options: ServerOptions) -> None:
    """Install the error handlers, then the API key check and CORS middleware that ``options`` asks for (CORS
    outermost, so a browser's preflight, which carries no key, is answered and every answer has CORS headers)."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected_error)
    if options.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=options.api_key)
    if options.allowed_origins:
        app.add_middleware(OpenAICORSMiddleware, allow_origins=list(options.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])


class ErrorResponse(JSONResponse):
    """OpenAI's error body as ASCII JSON: a message quoting a client's text (a lone surrogate included) always
    encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def _error(status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
           headers: dict[str, str] | None = None) -> ErrorResponse:
    return ErrorResponse(APIError(message, status=status, type=type, code=code).body(), status_code=status,
                         headers=headers)


async def _api_error(_: Request, exc: APIError) -> ErrorResponse:
    headers = {"Retry-After": "1"} if exc.status == 503 else None
    return ErrorResponse(exc.body(), status_code=exc.status, headers=headers)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}; this server serves {ROUTES}"
    elif exc.status_code == 405:
        message = (f"{request.url.path} does not take {request.method}; it takes "
                   f"{(exc.headers or {}).get('Allow', 'another method')}")
    else:
        message = str(exc.detail)
    headers = {k: v for k, v in (exc.headers or {}).items() if k.lower() != "content-length"}
    return _error(exc.status_code, message, "invalid_request_error" if exc.status_code < 500 else "server_error",
                  headers=headers)


async def _validation_error(_: Request, exc: RequestValidationError) -> ErrorResponse:
    return _error(422, f"the request does not match this endpoint: {exc.errors()!r:.300}")


async def _unexpected_error(request: Request, exc: Exception) -> ErrorResponse:
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return _error(500, f"the server failed on this request ({type(exc).__name__}); it has been logged",
                  "server_error")


class ApiKeyMiddleware:
    """401 with OpenAI's body (code ``invalid_api_key``) for a request to any path but ``OPEN_PATHS`` without
    ``Authorization: Bearer <key>``; the key is compared in constant time. A plain ASGI middleware: streamed answers
    pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                reason = "no Authorization header" if not given else "a wrong API key"
                response = _error(401, f"the request has {reason}; send Authorization: Bearer <the server's "
                                       f"--api-key>", code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OpenAICORSMiddleware(CORSMiddleware):
    """Starlette's CORS middleware, with a refused preflight (an origin, method or header not allowed) answered by
    OpenAI's error body instead of plain text."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
        return _error(response.status_code, f"{response.body.decode()} (this server allows the origins given to "
                                             f"--allowed-origins)", headers=headers)
