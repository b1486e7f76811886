"""Structured outputs on the OpenAI-compatible server: a request body's ``response_format`` (OpenAI's ``text``,
``json_object``, ``json_schema``), vLLM's extra fields ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` (with ``guided_decoding_backend`` and ``guided_whitespace_pattern``) and newer vLLM's
``structured_outputs`` object, mapped to one ``GuidedDecodingParams`` for the engine.

Each constraint is parsed by xgrammar here, when the request is admitted (in the HTTP front end, before it reaches
the engine), so a bad schema, regex or grammar is a 400 naming the field with xgrammar's message; the engine then
compiles it against the tokenizer (cached per schema). See docs/structured_outputs.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from compile_attn.engine.requests.errors import InvalidRequestError
from compile_attn.engine.requests.guided_decoding import GrammarError, GuidedDecodingParams, check_syntax

# vLLM's request fields, each naming one constraint kind of GuidedDecodingParams
GUIDED_KINDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "grammar"}
# Options beside them: vLLM's backend name (with its ":option" suffixes) and whitespace pattern
GUIDED_OPTIONS = {"guided_decoding_backend": "backend", "guided_whitespace_pattern": "whitespace_pattern"}
GUIDED_FIELDS = frozenset({"response_format", "structured_outputs", *GUIDED_KINDS, *GUIDED_OPTIONS})
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def guided_params(body: Mapping[str, Any], tokenizer: Any = None) -> GuidedDecodingParams | None:
    """The body's structured-output constraint (None: none asked for), checked: APIError (400) naming the field for
    a malformed one, for more than one, and for a schema, regex or grammar xgrammar cannot parse (its message)."""
    found: list[tuple[str, dict[str, Any]]] = []  # (field, GuidedDecodingParams fields)
    fmt = body.get("response_format")
    if fmt is not None:
        kind = _response_format(fmt)
        if kind is not None:
            found.append(("response_format", kind))
    for field, kind in GUIDED_KINDS.items():
        value = body.get(field)
        if value is not None:
            found.append((field, {kind: value}))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, Mapping):
            raise GrammarError(f"structured_outputs must be an object such as {{'json': {{...}}}}, got "
                               f"{outputs!r:.80}", "structured_outputs")
        found.append(("structured_outputs", dict(outputs)))
    options = {name: body[field] for field, name in GUIDED_OPTIONS.items() if body.get(field) is not None}
    if not found:
        return None
    if len(found) > 1:
        raise GrammarError(f"a request takes one structured-output constraint; got "
                           f"{', '.join(f for f, _ in found)}", found[1][0])
    field, values = found[0]
    try:
        params = GuidedDecodingParams.from_mapping({**values, **options})
    except InvalidRequestError as exc:  # RequestTypeError included
        raise GrammarError(_field_message(str(exc), field), _param(field, options, str(exc))) from None
    if tokenizer is None:
        raise GrammarError("structured outputs need the model's tokenizer, and this server's model has none",
                           field)
    try:
        check_syntax(params, field)
    except GrammarError as exc:
        raise GrammarError(str(exc), field) from None  # xgrammar's message, or xgrammar missing
    return params


def _response_format(fmt: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as GuidedDecodingParams fields (None for ``text``)."""
    if not isinstance(fmt, Mapping) or not isinstance(fmt.get("type"), str):
        raise GrammarError(f"response_format must be an object with a 'type' ({', '.join(RESPONSE_FORMATS)}), "
                           f"got {fmt!r:.80}", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping):
            raise GrammarError("response_format of type json_schema needs a json_schema object: {'name': ..., "
                               "'schema': {...}}", "response_format")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise GrammarError("response_format.json_schema needs its 'schema' (a JSON schema object)",
                               "response_format")
        if not isinstance(schema, (Mapping, bool)):
            raise GrammarError(f"response_format.json_schema.schema must be a JSON schema object, got "
                               f"{schema!r:.80}", "response_format")
        return {"json": schema}
    raise GrammarError(f"response_format type {kind!r:.40} is not supported; use one of "
                       f"{', '.join(RESPONSE_FORMATS)}", "response_format")


def _field_message(message: str, field: str) -> str:
    """The engine's ``guided_decoding.<name>`` message, with the request's field named instead."""
    return message.replace("guided_decoding.", f"{field}: ", 1) if "guided_decoding." in message else \
        f"{field}: {message}"


def _param(field: str, options: Mapping[str, Any], message: str) -> str:
    """The request field a GuidedDecodingParams error is about: an option's own field if it names one."""
    for request_field, name in GUIDED_OPTIONS.items():
        if request_field in options or name in options:
            if f"guided_decoding.{name}" in message:
                return request_field
    return field
