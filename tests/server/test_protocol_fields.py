"""``protocol.parse`` and the request schemas without a server: the fields each route knows are its pydantic model's,
and every one of them is handled (read, passed to SamplingParams, ignored on purpose, or refused unless neutral);
unknown fields are ignored with one warning naming them; known-but-unsupported ones pass at their neutral value and
are refused by name otherwise; several prompts, echo texts and the vLLM defaults (add_special_tokens) come out as
vLLM gives them."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("fastapi")

from compile_attn.server import protocol, schemas  # noqa: E402
from compile_attn.server.protocol import APIError, parse  # noqa: E402

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}" \
           "{% if add_generation_prompt %}<|assistant|>{% endif %}"


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i + 1 for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab["<s>"] = 0
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import processors
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>")
    tok.chat_template = TEMPLATE
    return tok


def _parse(body: dict, tokenizer, chat: bool = False, max_context: int = 256):
    return parse(body, chat=chat, tokenizer=tokenizer, model_name="m", max_context=max_context)


def test_every_schema_field_is_handled_and_every_handled_field_is_in_a_schema() -> None:
    handled = protocol.HANDLED | protocol.IGNORED | set(protocol.SAMPLING_FIELDS) | set(protocol.CHAT_UNSUPPORTED)
    for chat, model in ((False, schemas.CompletionRequest), (True, schemas.ChatCompletionRequest)):
        assert protocol.known_fields(chat) == set(model.model_fields)
        assert set(model.model_fields) <= handled, set(model.model_fields) - handled
    assert handled <= protocol.COMPLETION_FIELDS | protocol.CHAT_FIELDS
    assert "echo" in protocol.COMPLETION_FIELDS and "echo" not in protocol.UNSUPPORTED  # echo: completions only
    described = schemas.component_schemas()
    assert {m.__name__ for m in schemas.REQUEST_MODELS} <= set(described)
    assert "$defs" not in str(described) and "#/components/schemas/ChatMessage" in str(described)


def test_unknown_fields_are_ignored_with_one_warning(tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="compile_attn.server.protocol"):
        req = _parse({"prompt": "ab", "frobnicate": 1, "kv_transfer_params": {}, "user": "u", "max_tokens": 3},
                     tokenizer)
    assert req.params.max_tokens == 3
    (record,) = caplog.records
    assert "'frobnicate'" in record.getMessage() and "'kv_transfer_params'" in record.getMessage()
    assert "user" not in record.getMessage()  # known (and ignored on purpose): no warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="compile_attn.server.protocol"):
        _parse({"prompt": "ab", "max_tokens": 3, "user": "u", "spaces_between_special_tokens": False}, tokenizer)
        _parse({"messages": [{"role": "user", "content": "hi"}], "user": "u", "parallel_tool_calls": True},
               tokenizer, chat=True)
    assert not caplog.records


@pytest.mark.parametrize("field,neutral,other", [
    ("best_of", [None, 1], [2, True]), ("logit_bias", [None, {}], [{"5": 1.0}]), ("suffix", [None, ""], ["x"]),
    ("use_beam_search", [None, False], [True, 0]), ("length_penalty", [None, 1, 1.0], [0.5]),
    ("priority", [None, 0], [1, False]), ("prompt_logprobs", [None], [0, 1]),
])
def test_unsupported_fields_pass_neutral_values_only(tokenizer, field: str, neutral: list, other: list) -> None:
    for value in neutral:
        _parse({"prompt": "ab", field: value}, tokenizer)
    for value in other:
        with pytest.raises(APIError) as info:
            _parse({"prompt": "ab", field: value}, tokenizer)
        assert info.value.param == field and "not supported" in info.value.message


def test_best_of_equal_to_n_is_neutral(tokenizer) -> None:
    assert _parse({"prompt": "ab", "n": 3, "best_of": 3}, tokenizer).n == 3
    with pytest.raises(APIError, match="best_of"):
        _parse({"prompt": "ab", "n": 2, "best_of": 3}, tokenizer)


def test_prompts_echo_and_special_tokens(tokenizer) -> None:
    req = _parse({"prompt": ["ab", [7, 8, 9], "c"], "n": 2, "echo": True, "model": None}, tokenizer)
    assert req.prompts == [tokenizer("ab")["input_ids"], [7, 8, 9], tokenizer("c")["input_ids"]]
    assert req.prompts[0][0] == 0 and req.num_choices == 6
    assert req.echo_texts == ["ab", tokenizer.decode([7, 8, 9], skip_special_tokens=True), "c"]
    req = _parse({"prompt": "ab", "add_special_tokens": False}, tokenizer)
    assert req.prompts == [tokenizer("ab", add_special_tokens=False)["input_ids"]]
    assert _parse({"prompt": [[3, 4]]}, tokenizer).prompts == [[3, 4]]
    assert _parse({"prompt": [3, 4]}, tokenizer).prompts == [[3, 4]]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    text = tokenizer.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=False)
    assert _parse(chat, tokenizer, chat=True).prompts == [tokenizer(text, add_special_tokens=False)["input_ids"]]
    assert _parse({**chat, "add_special_tokens": True}, tokenizer, chat=True).prompts == [tokenizer(text)["input_ids"]]
    text = tokenizer.apply_chat_template(chat["messages"], add_generation_prompt=False, tokenize=False)
    assert _parse({**chat, "add_generation_prompt": False}, tokenizer, chat=True).prompts == [
        tokenizer(text, add_special_tokens=False)["input_ids"]]


def test_vllm_sampling_fields_reach_sampling_params(tokenizer) -> None:
    p = _parse({"prompt": "ab", "max_tokens": 9, "min_tokens": 4, "top_k": -1, "skip_special_tokens": False,
                "include_stop_str_in_output": True, "request_id": "abc"}, tokenizer)
    assert (p.params.min_tokens, p.params.top_k, p.params.skip_special_tokens, p.params.include_stop_str_in_output,
            p.request_id) == (4, 0, False, True, "abc")
    with pytest.raises(APIError) as info:
        _parse({"prompt": "ab", "min_tokens": 17}, tokenizer)  # more than the default max_tokens (16)
    assert info.value.param == "min_tokens"
    assert _parse({"prompt": "ab", "min_tokens": 17, "max_tokens": 17}, tokenizer).params.min_tokens == 17


STRUCTURED = [  # request field and value -> GuidedDecodingParams' field and value
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}},
     {"json": {"type": "object"}}),
    ({"guided_regex": "a+"}, {"regex": "a+"}),
    ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"guided_grammar": 'root ::= "x"'}, {"grammar": 'root ::= "x"'}),
    ({"guided_json": {"type": "object"}, "guided_decoding_backend": "xgrammar"}, {"json": {"type": "object"}}),
    ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("fields,expected", STRUCTURED)
def test_structured_output_fields_are_known_and_reach_guided_decoding(
        tokenizer, caplog: pytest.LogCaptureFixture, chat: bool, fields: dict, expected: dict) -> None:
    pytest.importorskip("xgrammar")
    from compile_attn.engine.requests.guided_decoding import GuidedDecodingParams

    assert set(fields) <= protocol.known_fields(chat) and not set(fields) & set(protocol.UNSUPPORTED)
    described = schemas.component_schemas()["ChatCompletionRequest" if chat else "CompletionRequest"]["properties"]
    assert set(fields) <= set(described)  # /openapi.json lists them
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "ab"}
    with caplog.at_level(logging.WARNING, logger="compile_attn.server.protocol"):
        p = _parse({**body, **fields, "min_tokens": 2, "max_tokens": 8}, tokenizer, chat=chat)
    assert not caplog.records  # not an "unknown field" warning
    assert p.params.guided_decoding == GuidedDecodingParams(**expected)
    assert p.params.min_tokens == 2  # min_tokens and a grammar in one request
    assert _parse({**body, "max_tokens": 8}, tokenizer, chat=chat).params.guided_decoding is None
