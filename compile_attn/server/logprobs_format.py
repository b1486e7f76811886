"""OpenAI's ``logprobs`` objects from the engine's per-token logprobs (one ``dict[int, Logprob]`` per output token,
the sampled token first): the completions form (``tokens`` / ``token_logprobs`` / ``top_logprobs`` /
``text_offset``) and the chat form (``content``: token, logprob, bytes, top_logprobs). Formatting only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from compile_attn.engine.execution.sampling.logprobs import Logprob

Entry = dict[int, Logprob]


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token's text as OpenAI shows it (its decode alone; a piece of a character decodes to U+FFFD)."""
    return str(token_id) if tokenizer is None else tokenizer.decode([token_id])


def _top(entry: Entry, num_top: int) -> list[tuple[int, Logprob]]:
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= num_top), key=lambda x: x[1].rank)[:num_top]


def completion_logprobs(entries: Sequence[Entry], token_ids: Sequence[int], tokenizer: Any, num_top: int,
                        offset: int = 0) -> dict[str, list]:
    """The /v1/completions ``logprobs`` of ``token_ids`` (whose logprobs are ``entries``), text offsets counted from
    ``offset`` characters into the choice's text."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, entry in zip(token_ids, entries):
        text = token_text(tokenizer, tok)
        out["tokens"].append(text)
        out["token_logprobs"].append(entry[tok].logprob)
        out["top_logprobs"].append({token_text(tokenizer, t): lp.logprob for t, lp in _top(entry, num_top)})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(entries: Sequence[Entry], token_ids: Sequence[int], tokenizer: Any,
                  num_top: int) -> dict[str, list]:
    """The /v1/chat/completions ``logprobs`` of ``token_ids`` (whose logprobs are ``entries``)."""

    def item(t: int, lp: Logprob) -> dict[str, Any]:
        text = token_text(tokenizer, t)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for tok, entry in zip(token_ids, entries):
        content.append({**item(tok, entry[tok]), "top_logprobs": [item(t, lp) for t, lp in _top(entry, num_top)]})
    return {"content": content}


def merge(chat: bool, parts: Sequence[dict[str, list]]) -> dict[str, list] | None:
    """Several Deltas' logprobs objects as one (a whole response's)."""
    if not parts:
        return None
    keys = ("content",) if chat else ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [x for p in parts for x in p[k]] for k in keys}
