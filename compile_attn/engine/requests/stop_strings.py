"""Stop strings: find where a request's decoded output text first contains one of its ``SamplingParams.stop``.

The output is decoded incrementally with the ``tokenizers`` library's ``DecodeStream`` (never a broken UTF-8
character), and after each token only the text that a new match could touch is searched, so a string spanning
several tokens is found at the token that completes it at constant cost per token. Only requests with stop strings
pay for this; nothing here touches engine state beyond the matcher itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from compile_attn.engine.requests.errors import RequestTypeError


def backend_tokenizer(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind an HF fast tokenizer (or the tokenizer itself if it is one); stop strings
    need it. RequestTypeError naming the way out otherwise."""
    if tokenizer is None:
        raise RequestTypeError("stop strings need a tokenizer to decode the output, and this LLM has none; pass "
                               "LLM(..., tokenizer=...), or stop on token ids with stop_token_ids=[...]")
    inner = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not callable(getattr(inner, "decode", None)) or not hasattr(inner, "token_to_id"):
        raise RequestTypeError(f"stop strings need a fast (tokenizers-backed) tokenizer, got "
                               f"{type(tokenizer).__name__}; load it with use_fast=True, or use stop_token_ids=[...]")
    return inner


class StopStringMatcher:
    """Decodes one request's output tokens as they come and reports the first stop string in the text.

    ``update(token_ids, prompt_len)`` takes the request's tokens so far, prompt first (it decodes only the output
    tokens it has not seen; if the output got shorter, after an undone step, it starts over) and returns
    ``(cut, stop)`` for the first match: the text before the stop string and the string; None while nothing
    matches.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str], *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = backend_tokenizer(tokenizer)
        self.stops = tuple(stops)
        self.longest = max(map(len, self.stops))
        self.skip_special_tokens = skip_special_tokens
        self._reset()

    def _reset(self) -> None:
        from tokenizers.decoders import DecodeStream  # here: the engine imports without tokenizers (core install)

        self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        self.text = ""
        self.num_seen = 0

    def update(self, token_ids: Sequence[int], prompt_len: int) -> tuple[str, str] | None:
        if self.num_seen > len(token_ids) - prompt_len:
            self._reset()
        for tok in token_ids[prompt_len + self.num_seen:]:
            self.num_seen += 1
            chunk = self.stream.step(self.tokenizer, tok)
            if not chunk:
                continue
            start = max(0, len(self.text) - self.longest + 1)  # a new match must end inside the new chunk
            self.text += chunk
            found = [(at, s) for s in self.stops if (at := self.text.find(s, start)) >= 0]
            if found:
                at, stop = min(found)
                return self.text[:at], stop
        return None
