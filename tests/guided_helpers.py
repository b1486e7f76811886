"""Helpers of the structured-output tests (offline and served): an independent check of an output against the tests'
JSON schemas, and a model biased to close what it opens (``closing_bias``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from compile_attn.engine import LLM


@contextlib.contextmanager
def closing_bias(llm: LLM, bias: float = 8.0) -> Iterator[None]:
    """The model's logits plus ``bias`` on EOS and on tokens made of quotes and closing braces only, plus half of it
    on tokens made of closing brackets, minus it on whitespace-only tokens: a model that closes what it opens (a
    string, an object, an array) soon and does not pad, so that an unbounded constraint (any JSON object, any
    whitespace) ends well within max_tokens. The grammar still decides which tokens may come."""
    tok, runner = llm.tokenizer, llm.step_runner
    texts = [tok.decode([t]) for t in range(llm.vocab_size)]
    add = torch.zeros(llm.vocab_size)
    add[[t for t, x in enumerate(texts) if x and not x.strip()]] = -bias
    add[[t for t, x in enumerate(texts) if x.strip() and not x.strip().strip(']')]] = bias / 2
    add[[t for t, x in enumerate(texts) if x.strip() and not x.strip().strip('"}')]] = bias
    add[tok.eos_token_id] = bias
    head = runner.compute_logits

    def biased(hidden: torch.Tensor) -> torch.Tensor:
        out = head(hidden)
        return out + add.to(out.device, out.dtype)

    runner.compute_logits = biased
    try:
        yield
    finally:
        runner.compute_logits = head


def _same_json(a: Any, b: Any) -> bool:
    """JSON equality (``True`` is not ``1``)."""
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


def check_schema(value: Any, schema: dict) -> None:
    """``value`` is valid against ``schema``, one of the generated schemas' forms: an object of named properties
    (string with maxLength, integer with a range, boolean, enum) with a required list. Checked by hand, and by
    ``jsonschema`` where it is installed."""
    assert isinstance(value, dict), value
    props = schema["properties"]
    assert set(schema["required"]) <= set(value), (value, schema["required"])
    assert set(value) <= set(props), (value, props)  # xgrammar's strict mode: no properties the schema leaves out
    for name, v in value.items():
        p = props[name]
        if "enum" in p:
            assert any(_same_json(v, e) for e in p["enum"]), (name, v, p)
        elif p["type"] == "string":
            assert isinstance(v, str) and len(v) <= p["maxLength"], (name, v, p)
        elif p["type"] == "integer":
            assert isinstance(v, int) and not isinstance(v, bool) and p["minimum"] <= v <= p["maximum"], (name, v, p)
        else:
            assert isinstance(v, bool), (name, v, p)
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(value, schema)
