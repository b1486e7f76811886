"""The HTTP server's own options (request size limit, CORS origins, API key): one frozen, picklable dataclass that
``compile-attn serve`` builds from its flags and that travels to the front end's process unchanged. It owns the
values and their checks, not how the app applies them (``compile_attn.server.app``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# The longest legitimate body is a prompt filling the context: 131,072 tokens are well under 1 MiB as text (about
# 4 bytes a token) or as JSON token ids (at most 7 bytes an id); 8 MiB leaves room for JSON-escaped non-ASCII text
# (6 bytes a character) and chat overhead, and bounds what one request can make the front end parse and hold.
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


@dataclass(frozen=True)
class ServerOptions:
    """How the HTTP app guards itself; the defaults are those of ``compile-attn serve``."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """A request body longer than this is refused with 413 (decided from Content-Length before reading, or while
    reading a chunked body) and never parsed."""
    allowed_origins: tuple[str, ...] = ()
    """Origins (``"https://app.example"``, or ``"*"`` for any) whose browser pages may call the API: CORS is off
    (no cross-origin page can read an answer) unless this names some."""
    api_key: str | None = field(default=None, repr=False)
    """When set, every ``/v1/*`` request needs ``Authorization: Bearer <api_key>`` (else 401); ``/health`` and
    ``/metrics`` stay open. Never shown in a repr or log line."""

    def __post_init__(self) -> None:
        if isinstance(self.max_request_bytes, bool) or not isinstance(self.max_request_bytes, int) \
                or self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be an int >= 1, got {self.max_request_bytes!r}")
        if isinstance(self.allowed_origins, str) or not all(isinstance(o, str) and o for o in self.allowed_origins):
            raise ValueError(f"allowed_origins must be a tuple of non-empty origin strings, got "
                             f"{self.allowed_origins!r}; e.g. ('https://app.example',) or ('*',)")
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")


def parse_origins(text: str) -> tuple[str, ...]:
    """``--allowed-origins`` as a tuple: a JSON list (``'["https://a.example", "https://b.example"]'``, vLLM's
    form) or comma-separated origins; ``*`` allows any origin."""
    text = text.strip()
    if text.startswith("["):
        try:
            origins = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--allowed-origins {text!r} is not a JSON list ({exc}); pass e.g. "
                             f"'[\"https://app.example\"]' or https://app.example,https://b.example") from None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise ValueError(f"--allowed-origins must be a JSON list of strings, got {text!r}")
    else:
        origins = text.split(",")
    return tuple(o.strip() for o in origins if o.strip())
