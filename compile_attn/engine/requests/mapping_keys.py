"""The key check of a request object built from a dict (``SamplingParams.from_mapping``,
``GuidedDecodingParams.from_mapping``): every key must be a known name, and the unknown ones are refused together, by
name, with the known names listed. Each caller words its own message; nothing here knows a request field."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import fields

from compile_attn.engine.requests.errors import InvalidRequestError


def field_names(cls: type) -> set[str]:
    """The names of a dataclass's fields."""
    return {f.name for f in fields(cls)}


def refuse_unknown_keys(keys: Iterable[str], accepted: Collection[str], what: str, *,
                        known: Iterable[str] | None = None,
                        error: type[Exception] = InvalidRequestError) -> None:
    """Raise ``error("<what> 'a', 'b'; known: <names>")`` when some of ``keys`` are not in ``accepted``. The names
    listed are ``known`` (default: ``accepted``), sorted; ``what`` starts the message (e.g. "unknown sampling
    parameter(s)")."""
    unknown = [k for k in keys if k not in accepted]
    if unknown:
        listed = accepted if known is None else known
        raise error(f"{what} {', '.join(map(repr, unknown))}; known: {', '.join(sorted(listed))}")
