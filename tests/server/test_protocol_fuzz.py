"""``protocol.parse`` on arbitrary JSON bodies (hypothesis): every body either parses into a request the engine can
take (its prompt within the context with room for ``max_tokens``, ``n`` in range) or is refused with APIError naming
a field; nothing else escapes (an escaping exception would be a 500 instead of a 400)."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compile_attn.server.protocol import HANDLED, IGNORED, SAMPLING_FIELDS, UNSUPPORTED, APIError, Parsed, parse

MAX_CONTEXT = 64
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"

json_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
                | st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
plausible = {  # values of the right kind, some out of range: the parse must sort them
    "prompt": st.lists(st.integers(-1, 300), max_size=80) | st.text(max_size=30)
    | st.lists(st.text(max_size=10), max_size=2),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", ""]),
                                                "content": st.text(max_size=20) | st.none()}), max_size=3),
    "max_tokens": st.integers(-2, 2 * MAX_CONTEXT), "n": st.integers(-1, 20), "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5), "top_k": st.integers(-2, 50), "min_p": st.floats(-0.5, 1.5),
    "seed": st.integers(-5, 2**64), "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=5),
    "stop_token_ids": st.lists(st.integers(-1, 300), max_size=3), "logprobs": st.integers(-1, 30) | st.booleans(),
    "top_logprobs": st.integers(-1, 30), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "model": st.just("other") | st.none(),
    "min_tokens": st.integers(-1, 2 * MAX_CONTEXT), "echo": st.booleans(), "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "add_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(), "best_of": st.integers(0, 3), "logit_bias": st.just({}),
    "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
    "request_id": st.text(max_size=8),
}
common = sorted(set(SAMPLING_FIELDS) | IGNORED | HANDLED - {"model", "prompt", "messages"})
rare = sorted(set(UNSUPPORTED) | {"unknown_field", "model", "prompt", "messages"})
good_prompt = st.lists(st.integers(0, 255), min_size=1, max_size=40)
good_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                                "content": st.text(max_size=12)}), min_size=1, max_size=3)


@st.composite
def bodies(draw):
    """Mostly well-formed bodies with a few fields drawn from their plausible range or from any JSON value."""
    body = {"model": "m", "prompt": draw(good_prompt), "messages": draw(good_messages)}
    chosen = draw(st.lists(st.sampled_from(common), max_size=5, unique=True))
    if draw(st.integers(0, 9)) == 0:
        chosen.append(draw(st.sampled_from(rare)))
    for key in chosen:
        strategy = plausible.get(key)
        body[key] = draw(strategy if strategy is not None and draw(st.integers(0, 3)) else json_values)
    return body


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    tok.chat_template = TEMPLATE
    return tok


parsed: list[Parsed] = []  # what parsed, across examples: the test must reach both outcomes


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies(), chat=st.booleans(), with_tokenizer=st.booleans())
def test_a_body_parses_or_is_refused_by_field(tokenizer, body, chat, with_tokenizer) -> None:
    tok = tokenizer if with_tokenizer or chat else None
    try:
        req = parse(body, chat=chat, tokenizer=tok, model_name="m", max_context=MAX_CONTEXT)
    except APIError as exc:
        assert exc.status in (400, 404) and exc.message
        assert exc.param is None or isinstance(exc.param, str)
        return
    assert isinstance(req, Parsed) and body.get("model") in ("m", None)
    parsed.append(req)
    assert req.prompts and (not chat or len(req.prompts) == 1)
    for ids in req.prompts:
        assert ids and all(isinstance(t, int) and t >= 0 for t in ids)
        assert len(ids) + req.params.max_tokens <= MAX_CONTEXT
    assert 1 <= req.n <= 16 and 0 <= req.params.min_tokens <= req.params.max_tokens
    assert req.params.temperature >= 0 and math.isfinite(req.params.temperature)
    assert req.echo_texts is None or (not chat and len(req.echo_texts) == len(req.prompts))


def test_the_fuzz_reached_both_outcomes() -> None:
    """Guards the strategy above: a good share of its bodies must parse (else the test checks refusals only)."""
    if not parsed:
        pytest.skip("run together with the fuzz test above")
    assert len(parsed) >= 50
