"""Server-sent event chunks in OpenAI's streaming format for one response: byte for byte what ``json.dumps`` of the
chunk object gives, built from the response's constant head and the few fields a Delta changes. A streamed token's
chunk is the front end's most frequent piece of work; ``json.dumps`` of the whole object took ~3 us of it, this
~0.5 us.
"""

from __future__ import annotations

import json
from typing import Any

_str = json.encoder.encode_basestring_ascii  # what json.dumps writes for a str (ensure_ascii, the default)
_UNFINISHED = ', "finish_reason": null, "stop_reason": null'  # every chunk but a sample's last


class ChunkFormat:
    """The chunks of one streamed response: ``id``, ``object``, ``created``, ``model``, then ``choices`` and, when
    the client asked for usage, ``usage`` (null on every chunk but the last)."""

    def __init__(self, rid: str, created: int, model: str, *, chat: bool, include_usage: bool) -> None:
        self.chat, self.include_usage = chat, include_usage
        self._head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                      "created": created, "model": model}
        self._prefix = "data: " + json.dumps(self._head)[:-1] + ', "choices": ['
        self._suffix = ("], \"usage\": null}\n\n" if include_usage else "]}\n\n")

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        """Any chunk, from its choice objects (the role chunk, the usage chunk)."""
        body: dict[str, Any] = dict(self._head, choices=choices)
        if self.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def delta(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None,
              token_ids: list[int] | None = None, stop_reason: int | str | None = None) -> str:
        """The chunk of one sample's Delta: what ``chunk([choice])`` gives for the choice
        ``app._choice(chat, index, text, finish_reason, delta=True, logprobs=..., token_ids=...,
        stop_reason=...)``."""
        if self.chat:
            body = '{"role": "assistant", "content": ' + _str(text) + "}" if text else "{}"
            parts = ['{"index": ', str(index), ', "delta": ', body]
        else:
            parts = ['{"index": ', str(index), ', "text": ', _str(text)]
        parts += [', "logprobs": ', "null" if logprobs is None else json.dumps(logprobs)]
        if finish_reason is None and stop_reason is None:
            parts.append(_UNFINISHED)
        else:
            parts += [', "finish_reason": ', "null" if finish_reason is None else _str(finish_reason),
                      ', "stop_reason": ', "null" if stop_reason is None else json.dumps(stop_reason)]
        if token_ids is not None:
            parts += [', "token_ids": [', ", ".join(map(str, token_ids)), "]"]
        return self._prefix + "".join(parts) + "}" + self._suffix
