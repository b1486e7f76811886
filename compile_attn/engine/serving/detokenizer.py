"""Incremental detokenisation of one request's output for streaming: text that is safe to send after each step.

Tokens are decoded with the ``tokenizers`` library's ``DecodeStream`` (a character split over several byte tokens is
held back until it is whole), and text that could be the start of one of the request's stop strings is held back
until it is known not to be one, so what is sent never has to be taken back: the sent pieces concatenated equal the
request's final text (cut before its stop string, as ``LLM.generate`` returns it). The module decodes only: it
never reads or changes engine state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from compile_attn.engine.requests.request import text_ids

logger = logging.getLogger(__name__)


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could begin a stop string: the longest proper prefix of any of
    ``stops`` that ``text`` ends with (0 for none)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


class IncrementalDetokenizer:
    """One request's output text, piece by piece: ``push(new_token_ids)`` returns the text that became safe to send
    (complete characters, nothing that could be or start a stop string); ``finish(final_text)`` returns the rest,
    given the request's final text. A tokenizer without a ``tokenizers`` backend (a slow one) is decoded whole at
    each push instead, holding back a trailing replacement character."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), *, skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stops = tuple(stops)
        self.longest = max(map(len, self.stops), default=0)
        self.skip_special_tokens = skip_special_tokens
        inner = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._backend = inner if hasattr(inner, "token_to_id") and callable(getattr(inner, "decode", None)) else None
        if self._backend is not None:  # a tokenizers backend, so tokenizers is installed
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        else:
            self._stream = None
        self._ids: list[int] = []  # kept only without a backend (whole re-decode)
        self.text = ""  # decoded so far, complete characters only
        self.num_sent = 0  # characters of ``text`` sent

    @property
    def sent(self) -> str:
        return self.text[: self.num_sent]

    def push(self, token_ids: Sequence[int]) -> str:
        """Decode the request's next tokens; the text now safe to send (possibly empty)."""
        if self._stream is not None:
            for tok in token_ids:
                chunk = self._stream.step(self._backend, tok)
                if chunk:
                    self.text += chunk
        elif token_ids:
            self._ids.extend(token_ids)
            full = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens).rstrip("\ufffd")
            if full.startswith(self.text):
                self.text = full
        safe = len(self.text)
        if self.stops:
            safe -= held_back(self.text, self.stops)
            start = max(0, self.num_sent - self.longest + 1)
            hits = [at for s in self.stops if (at := self.text.find(s, start)) >= 0]
            if hits:  # a whole stop string whose request has not finished yet: never send from its start on
                safe = min(safe, min(hits))
        if safe <= self.num_sent:
            return ""
        piece = self.text[self.num_sent : safe]
        self.num_sent = safe
        return piece

    def delta_text(self, new_token_ids: Sequence[int], *, finished: bool, final_text: str | None,
                   output_ids: Sequence[int], finish_reason: str | None = None) -> str:
        """The text of one Delta: ``push(new_token_ids)``, or on the request's last Delta ``finish`` with its final
        text (``final_text``, or where the engine cut none the decode of its ``output_ids``, a stop token's text
        left out: see ``request.text_ids``)."""
        if not finished:
            return self.push(new_token_ids)
        if final_text is None:
            ids = text_ids(list(output_ids), finish_reason, self.include_stop_str_in_output)
            final_text = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.finish(final_text)

    def finish(self, final_text: str) -> str:
        """The text still to send once the request finished, ``final_text`` being its whole output text (cut before a
        matched stop string, or the full decode). Empty, with a warning, in the rare case where ``final_text``
        does not begin with what was already sent."""
        sent = self.sent
        if not final_text.startswith(sent):
            logger.warning("the final text %r does not begin with the text already streamed %r; sending nothing more",
                           final_text[:40], sent[:40])
            return ""
        self.text, self.num_sent = final_text, len(final_text)
        return final_text[len(sent):]


def detokenizer_for(tokenizer: Any, params: Any) -> IncrementalDetokenizer:
    """The IncrementalDetokenizer of a request with SamplingParams ``params`` (its stop strings, whether special
    tokens and the stop string stay in the text)."""
    return IncrementalDetokenizer(tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens,
                                  include_stop_str_in_output=params.include_stop_str_in_output)
