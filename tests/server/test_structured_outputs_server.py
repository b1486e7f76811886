"""Structured outputs through the OpenAI-compatible server with the ``openai`` client: ``response_format``
(json_schema, json_object, text) and vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` (and newer vLLM's ``structured_outputs``) on /v1/completions and /v1/chat/completions, whole and
streamed; every output checked independently (``json.loads`` and the schema, ``re``, membership). A bad schema,
regex or grammar is a 400 naming the field with xgrammar's message; a schema is compiled once however often it comes.
The served model closes what it opens soon (``closing_bias``), so unbounded constraints end within max_tokens."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from compile_attn.cli import build_parser, main
from compile_attn.engine import SamplingParams
from tests.guided_helpers import check_schema, closing_bias
from tests.server.conftest import MODEL, Served

pytest.importorskip("xgrammar")

PROMPT = "The function returns"
MESSAGES = [{"role": "user", "content": "Describe the list as JSON."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "sorted": {"type": "boolean"}, "kind": {"enum": ["list", "tuple"]}},
          "required": ["name", "size", "kind"]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
MAX_TOKENS = 120


@pytest.fixture
def biased(served: Served) -> Iterator[Served]:
    with closing_bias(served.llm):
        yield served
    served.wait_idle()


def _post(served: Served, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(served.url + path, data=json.dumps({"model": MODEL, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema_chat_and_completions(biased: Served, temperature: float) -> None:
    client = biased.client()
    kw = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=temperature, seed=3)
    chat = client.chat.completions.create(messages=MESSAGES, response_format=JSON_SCHEMA, n=2, **kw)
    texts = [(c.message.content, c.finish_reason) for c in chat.choices]
    chunks = list(client.chat.completions.create(messages=MESSAGES, response_format=JSON_SCHEMA, stream=True, **kw))
    texts.append(("".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason))
    done = client.completions.create(prompt=PROMPT, extra_body={"response_format": JSON_SCHEMA}, **kw)
    texts.append((done.choices[0].text, done.choices[0].finish_reason))
    for text, finish in texts:
        assert finish == "stop", text
        check_schema(json.loads(text), SCHEMA)


def test_json_object_and_text(biased: Served) -> None:
    client = biased.client()
    for temperature in (0.0, 1.0):
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, n=2, seed=1,
                                             temperature=temperature, response_format={"type": "json_object"})
        for c in out.choices:
            assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict), c.message.content
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].text == plain.choices[0].text


def test_vllm_guided_fields(biased: Served) -> None:
    client = biased.client()
    regex, choices = r"[a-z]{2,6}@[a-z]{2,5}\.com", ["list", "tuple", "dict"]
    grammar = 'root ::= "[" [0-9] ("," [0-9]){0,4} "]"'
    cases = [({"guided_json": SCHEMA}, lambda t: check_schema(json.loads(t), SCHEMA) is None),
             ({"guided_json": json.dumps(SCHEMA), "guided_decoding_backend": "xgrammar:disable-any-whitespace"},
              lambda t: check_schema(json.loads(t), SCHEMA) is None and not re.search(r"\s{2}|\n", t)),
             ({"guided_regex": regex}, lambda t: re.fullmatch(regex, t)),
             ({"guided_choice": choices}, lambda t: t in choices),
             ({"guided_grammar": grammar}, lambda t: re.fullmatch(r"\[\d(,\d){0,4}\]", t)),
             ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda t: re.fullmatch("[0-9]{3}", t))]
    for extra, check in cases:
        for temperature in (0.0, 1.0):
            chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, seed=2,
                                                  temperature=temperature, extra_body=extra)
            done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, seed=2,
                                             temperature=temperature, extra_body=extra)
            for text, finish in ((chat.choices[0].message.content, chat.choices[0].finish_reason),
                                 (done.choices[0].text, done.choices[0].finish_reason)):
                assert finish == "stop" and check(text), (extra, text)


def test_greedy_output_matches_the_offline_api(served: Served) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, guided_decoding={"regex": "[a-z ]{1,20}\\."})
    want = served.reference.generate(PROMPT, params)[0].text
    got = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"guided_regex": "[a-z ]{1,20}\\."})
    assert got.choices[0].text == want
    served.wait_idle()


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "Unsupported type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"response_format": "json"}, "response_format", "type"),
    ({"guided_json": "{not json"}, "guided_json", "JSON"),
    ({"guided_regex": "(ab"}, "guided_regex", "parenthesis"),
    ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar", "EBNF"),
    ({"guided_choice": "yes"}, "guided_choice", "list"),
    ({"guided_choice": []}, "guided_choice", "empty"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one structured-output constraint"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "one"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
    ({"structured_outputs": {"regex": "a", "json_object": True}}, "structured_outputs", "exactly one"),
]


@pytest.mark.parametrize("extra,field,words", BAD, ids=[f"{f}-{i}" for i, (_, f, _) in enumerate(BAD)])
def test_a_bad_constraint_is_400_naming_the_field(served: Served, extra: dict, field: str, words: str) -> None:
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})):
        status, err = _post(served, path, {**body, "max_tokens": 4, **extra})
        assert status == 400, err
        assert err["error"]["param"] == field and err["error"]["type"] == "invalid_request_error", err
        assert words in err["error"]["message"] and "/project/" not in err["error"]["message"], err
    served.wait_idle()


def test_bad_schema_through_the_openai_client(served: Served) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}}
    with pytest.raises(openai.BadRequestError) as info:
        served.client().chat.completions.create(model=MODEL, messages=MESSAGES, response_format=bad, stream=True)
    assert info.value.body["param"] == "response_format"
    assert "properties must be an object" in info.value.body["message"]
    served.wait_idle()


def test_a_schema_is_compiled_once(biased: Served) -> None:
    client = biased.client()
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "boolean"}},
              "required": ["k", "v"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "kv", "schema": schema}}
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, response_format=fmt)
    before = biased.llm.grammars.num_compiled
    for k in range(3):
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, seed=k,
                                             temperature=1.0, response_format=fmt)
        value = json.loads(out.choices[0].message.content)
        assert value["k"] in ("a", "b") and isinstance(value["v"], bool)
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, extra_body={"guided_json": schema})
    assert biased.llm.grammars.num_compiled == before


def test_bench_serve_sends_response_format(biased: Served, tmp_path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "json_object.json"
    rc = main(["bench-serve", "--url", biased.url, "--served-model-name", MODEL, "--vocab-size", "50",
               "--num-seqs", "3", "--prompt-len", "4", "--output-len", "60", "--num-warmup", "0",
               "--response-format", "json_object", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    (r,) = result["rates"]
    assert result["config"]["response_format"] == "json_object"
    assert (r["completed"], r["errors"]) == (3, 0) and 3 <= r["output_tokens"] < 180 and r["output_tok_per_s"] > 0
    assert "response_format json_object" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--tiny", "--response-format", "json_object"], "needs a model with a tokenizer"),
    (["--model", "x", "--offline", "--response-format", "json_object"], "drop --offline"),
])
def test_bench_serve_response_format_options_are_checked(argv: list[str], message: str) -> None:
    args = build_parser().parse_args(["bench-serve", *argv])
    with pytest.raises(ValueError, match=message):
        args.prepare(args)
