"""GuidedDecodingParams: a request's structured-output constraint (JSON schema, regex, choice, grammar or any JSON
object), in vLLM's shape, and the checks that refuse a bad one by name before a request is queued.

Nothing here needs xgrammar except ``check_syntax`` and ``import_xgrammar``, which import it on first use: a request
without a constraint never imports it. The engine compiles the constraint against the model's tokenizer
(``engine/execution/sampling/grammar.py``); see docs/structured_outputs.md.
"""

from __future__ import annotations

import importlib
import json as _json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from compile_attn.engine.requests.errors import InvalidRequestError, RequestTypeError
from compile_attn.engine.requests.mapping_keys import field_names, refuse_unknown_keys

KINDS = ("json", "regex", "choice", "grammar", "json_object")
EXTRA = "structured"  # the extra that installs xgrammar: pip install 'compile-attn[structured]'
BACKENDS = (None, "auto", "xgrammar")
# vLLM's backend options (``backend="xgrammar:disable-any-whitespace"``) that this engine understands.
BACKEND_OPTIONS = {"disable-any-whitespace": "disable_any_whitespace", "disable_any_whitespace":
                   "disable_any_whitespace", "no-fallback": "disable_fallback",
                   "no-additional-properties": "disable_additional_properties"}
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # what json_object means: any JSON object (OpenAI's json_object mode)


class GrammarError(InvalidRequestError):
    """A guided-decoding constraint that xgrammar cannot parse or compile (a bad JSON schema, regex or grammar), or
    structured outputs without xgrammar installed. ``param`` names the field at fault (``guided_decoding.json``
    offline; the server puts its own field name there, e.g. ``response_format``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def import_xgrammar() -> Any:
    """The xgrammar module, imported on first use; GrammarError naming the extra that installs it otherwise."""
    try:
        return importlib.import_module("xgrammar")
    except ImportError as exc:
        raise GrammarError(f"structured outputs (guided_decoding, response_format, guided_json / guided_regex / "
                           f"guided_choice / guided_grammar) need the xgrammar package, which is not installed "
                           f"({exc}); pip install 'compile-attn[{EXTRA}]'", "guided_decoding") from None


@dataclass(frozen=True, init=False)
class GuidedDecodingParams:
    """One structured-output constraint, vLLM's ``GuidedDecodingParams``: exactly one of

    - ``json``: a JSON schema (a dict, its JSON text, or a pydantic model class); the output is one JSON value valid
      against it;
    - ``regex``: the output matches this regular expression (whole);
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: the output is a sentence of this EBNF grammar (xgrammar's GBNF dialect, rule ``root``; a Lark
      grammar is accepted too);
    - ``json_object=True``: the output is a JSON object (any keys and values).

    ``disable_any_whitespace`` keeps JSON free of whitespace beyond a single space after ``:`` and ``,`` (by
    default, as in vLLM, any whitespace may separate JSON tokens). ``backend`` may be None, "auto" or "xgrammar"
    (vLLM's ``"xgrammar:disable-any-whitespace"`` form too); ``disable_fallback`` and
    ``disable_additional_properties`` are accepted for vLLM's sake (there is no fallback, and properties a schema
    does not name are refused unless it allows them). ``whitespace_pattern`` and ``structural_tag`` are not
    supported (refused by name when set). Also built from a dict of these fields (``from_mapping``)."""

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    structural_tag: str | None = None

    def __init__(self, json: str | Mapping[str, Any] | Any = None, regex: str | None = None,
                 choice: Iterable[str] | None = None, grammar: str | None = None, json_object: bool | None = None,
                 backend: str | None = None, whitespace_pattern: str | None = None,
                 disable_any_whitespace: bool = False, disable_additional_properties: bool = False,
                 disable_fallback: bool = False, structural_tag: str | None = None) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        put("json", _check_json(json))
        put("regex", _check_text("regex", regex))
        put("choice", _check_choice(choice))
        put("grammar", _check_text("grammar", grammar))
        if json_object is not None and not isinstance(json_object, bool):
            raise RequestTypeError(f"guided_decoding.json_object must be a bool, got {json_object!r:.60}")
        put("json_object", json_object)
        for name, value in (("disable_any_whitespace", disable_any_whitespace),
                            ("disable_additional_properties", disable_additional_properties),
                            ("disable_fallback", disable_fallback)):
            if not isinstance(value, bool):
                raise RequestTypeError(f"guided_decoding.{name} must be a bool, got {value!r:.60}")
            put(name, value)
        put("backend", backend)
        if backend is not None:
            name, _, options = str(backend).partition(":")
            if not isinstance(backend, str) or name not in ("auto", "xgrammar"):
                raise InvalidRequestError(f"guided_decoding.backend {backend!r:.60} is not available; this engine's "
                                          f"structured outputs use xgrammar (backend None, 'auto' or 'xgrammar')")
            for option in filter(None, options.split(",")):
                if option not in BACKEND_OPTIONS:
                    raise InvalidRequestError(f"guided_decoding.backend option {option!r:.60} is not known; known: "
                                              f"{', '.join(sorted(set(BACKEND_OPTIONS)))}")
                put(BACKEND_OPTIONS[option], True)
        for name, value in (("whitespace_pattern", whitespace_pattern), ("structural_tag", structural_tag)):
            if value is not None:
                raise InvalidRequestError(f"guided_decoding.{name} is not supported by this engine; leave it unset "
                                          f"(disable_any_whitespace=True keeps JSON compact)")
        put("whitespace_pattern", None)
        put("structural_tag", None)
        kinds = self.kinds
        if len(kinds) != 1:
            given = f"got {', '.join(kinds)}" if kinds else "got none"
            raise InvalidRequestError(f"guided_decoding takes exactly one of json, regex, choice, grammar, "
                                      f"json_object=True; {given}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> GuidedDecodingParams:
        """``GuidedDecodingParams(**values)``, refusing unknown keys by name."""
        refuse_unknown_keys(values, field_names(cls), "unknown guided_decoding field(s)")
        return cls(**values)

    @classmethod
    def of(cls, value: Any) -> GuidedDecodingParams | None:
        """``value`` as GuidedDecodingParams: None, one already, a dict of its fields, or any object with vLLM's
        field names (vLLM's own GuidedDecodingParams / StructuredOutputsParams)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls.from_mapping(value)
        names = [f.name for f in fields(cls)]
        if any(hasattr(value, n) for n in KINDS):
            return cls(**{n: getattr(value, n) for n in names if getattr(value, n, None) is not None})
        raise RequestTypeError(f"guided_decoding must be a GuidedDecodingParams or a dict of its fields (e.g. "
                               f"{{'regex': '[0-9]+'}}), got {type(value).__name__} {value!r:.60}")

    @property
    def kinds(self) -> list[str]:
        """The constraint kinds set (exactly one once constructed)."""
        return [k for k in KINDS if (getattr(self, k) is not None if k != "json_object" else bool(self.json_object))]

    @property
    def kind(self) -> str:
        """"json", "regex", "choice", "grammar" or "json_object"."""
        return self.kinds[0]

    @property
    def any_whitespace(self) -> bool:
        return not self.disable_any_whitespace

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on: (kind, the constraint's text, compact JSON for a schema, and
        any_whitespace). Two requests with equal keys share one compiled grammar."""
        kind = self.kind
        if kind == "json":
            spec: Any = schema_text(self.json)
        elif kind == "choice":
            spec = self.choice
        elif kind == "json_object":
            spec = JSON_OBJECT_SCHEMA
        else:
            spec = getattr(self, kind)
        whitespace = self.any_whitespace if kind in ("json", "json_object") else None
        return kind, spec, whitespace

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GuidedDecodingParams) and self.key == other.key


def schema_text(schema: str | Mapping[str, Any]) -> str:
    """A JSON schema as compact JSON text (no spaces; keys in their order: the output's properties come in the
    schema's order, so two orders are two grammars); a string that is not JSON stays as given (its compile then
    fails with the parser's message)."""
    if isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except ValueError:
            return schema
    return _json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


# Schema keywords whose values are data, not schemas: never rewritten.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "example", "required"})


def _xgrammar_schema(text: str) -> str:
    """The schema as xgrammar is given it: a length-bounded string (``minLength`` / ``maxLength`` without a
    ``pattern`` or ``format``) becomes the equivalent ``pattern`` over characters JSON allows unescaped. xgrammar
    0.2.8 builds such strings from "any character but a quote, a backslash, CR or LF", which lets raw control
    characters (a tab, U+0001, ...) in: the output would not be JSON. Its own bounded strings take no escapes
    either, so nothing valid is lost."""
    try:
        schema = _json.loads(text)
    except ValueError:
        return text
    changed = _bound_strings(schema)
    return _json.dumps(schema, ensure_ascii=False) if changed else text


def _bound_strings(node: Any) -> bool:
    """Rewrite, in place, the bounded string schemas under ``node`` (see ``_xgrammar_schema``); whether any was."""
    changed = False
    if isinstance(node, list):
        for item in node:
            changed |= _bound_strings(item)
        return changed
    if not isinstance(node, dict):
        return False
    bounds = ("minLength", "maxLength")
    if node.get("type") == "string" and any(k in node for k in bounds) and not ({"pattern", "format"} & set(node)):
        low, high = node.pop("minLength", 0), node.pop("maxLength", None)
        if isinstance(low, int) and (high is None or isinstance(high, int)):
            node["pattern"] = r'^[^"\\\x00-\x1f]{%d,%s}$' % (low, "" if high is None else high)
            changed = True
        else:  # not integers: left for xgrammar to refuse
            node["minLength"] = low
            if high is not None:
                node["maxLength"] = high
    for key, value in node.items():
        if key not in _DATA_KEYWORDS:
            changed |= _bound_strings(value)
    return changed


def choice_grammar(choices: Iterable[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (each a string literal, JSON-escaped)."""
    return "root ::= " + " | ".join(_json.dumps(c, ensure_ascii=False) for c in choices)


def _check_json(value: Any) -> str | Mapping[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, type) and hasattr(value, "model_json_schema"):  # a pydantic model class
        value = value.model_json_schema()
    if isinstance(value, bool):  # JSON Schema's true (anything) / false (nothing)
        return _json.dumps(value)
    if isinstance(value, str):
        if not value.strip():
            raise InvalidRequestError("guided_decoding.json is an empty string; pass a JSON schema (a dict or its "
                                      "JSON text)")
        return value
    if isinstance(value, Mapping):
        try:
            _json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise RequestTypeError(f"guided_decoding.json is not JSON-serialisable ({exc})") from None
        return value
    raise RequestTypeError(f"guided_decoding.json must be a JSON schema (a dict, its JSON text, or a pydantic model "
                           f"class), got {type(value).__name__} {value!r:.60}")


def _check_text(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestTypeError(f"guided_decoding.{name} must be a string, got {type(value).__name__} {value!r:.60}")
    if not value:
        raise InvalidRequestError(f"guided_decoding.{name} is an empty string")
    return value


def _check_choice(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise RequestTypeError(f"guided_decoding.choice must be a list of strings, got {type(value).__name__} "
                               f"{value!r:.60}")
    choices = tuple(value)
    if not choices:
        raise InvalidRequestError("guided_decoding.choice is an empty list; give at least one string")
    for c in choices:
        if not isinstance(c, str):
            raise RequestTypeError(f"guided_decoding.choice entries must be strings, got {type(c).__name__} "
                                   f"{c!r:.40}")
        if not c:
            raise InvalidRequestError("guided_decoding.choice has an empty string; every choice needs a character")
    return choices


_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error text without its C++ source location (``[12:00:00] /project/cpp/x.cc:83: ...``)."""
    text = str(exc).strip()
    return _XGRAMMAR_PREFIX.sub("", text).strip() or type(exc).__name__


def grammar_source(params: GuidedDecodingParams) -> tuple[str, Any]:
    """How to build the constraint: ("json_schema", schema text), ("regex", pattern) or ("ebnf", grammar text)."""
    kind = params.kind
    if kind == "json":
        return "json_schema", _xgrammar_schema(schema_text(params.json))  # type: ignore[arg-type]
    if kind == "json_object":
        return "json_schema", JSON_OBJECT_SCHEMA
    if kind == "regex":
        return "regex", params.regex
    if kind == "choice":
        return "ebnf", choice_grammar(params.choice or ())
    return "ebnf", params.grammar


def build_grammar(params: GuidedDecodingParams, param: str | None = None) -> Any:
    """The xgrammar ``Grammar`` of ``params`` (parsing only: no tokenizer needed); GrammarError naming ``param``
    (default ``guided_decoding.<kind>``) with xgrammar's message for a bad schema, regex or grammar. A ``grammar``
    that is not EBNF is tried as Lark before it is refused (with the EBNF parser's message)."""
    xgr = import_xgrammar()
    how, source = grammar_source(params)
    where = param or f"guided_decoding.{params.kind}"
    try:
        if how == "json_schema":
            return xgr.Grammar.from_json_schema(source, any_whitespace=params.any_whitespace, strict_mode=True)
        if how == "regex":
            return xgr.Grammar.from_regex(source)
        try:
            return xgr.Grammar.from_ebnf(source)
        except Exception:
            if params.kind != "grammar":
                raise
            try:
                return xgr.Grammar.from_lark(source)
            except Exception:  # noqa: BLE001 - report the EBNF parser's message, the grammar's documented form
                pass
            raise
    except GrammarError:
        raise
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError (and others) with its parser's message
        what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice list",
                "grammar": "grammar"}[params.kind]
        raise GrammarError(f"{where}: invalid {what}: {xgrammar_message(exc)}", where) from None


def check_syntax(params: GuidedDecodingParams, param: str | None = None) -> None:
    """Refuse a constraint xgrammar cannot parse (GrammarError naming ``param``); what an HTTP front end runs on a
    request before it reaches the engine."""
    build_grammar(params, param)
