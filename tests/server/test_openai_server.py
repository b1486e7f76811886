"""The OpenAI-compatible server driven by the official ``openai`` client over loopback: completions and chat, whole
and streamed, against a separate LLM's ``generate`` / ``chat`` on the same model; stop strings, seeds, n, usage;
every refused request (400 naming the field); aborted streams and a concurrent load leave the KV pool fresh. vLLM's
request fields (a list of prompts, echo, top_k=-1, min_tokens, skip_special_tokens, include_stop_str_in_output, no
model, stop_reason, unknown fields ignored), the log line per request, and /tokenize, /detokenize, /version and
/openapi.json."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request

import openai
import pytest

from compile_attn.engine import SamplingParams
from tests.server.conftest import MODEL, Served

PROMPT = "The function returns"
MESSAGES = [{"role": "user", "content": "What does the list do?"}]


def test_models_and_health(served: Served) -> None:
    assert [m.id for m in served.client().models.list().data] == [MODEL]
    with urllib.request.urlopen(served.url + "/health", timeout=5) as r:
        assert r.status == 200


@pytest.mark.parametrize("stop", [None, "x"], ids=["plain", "stop"])
def test_completion_whole_and_streamed_match_generate(served: Served, stop: str | None) -> None:
    client = served.client()
    full = served.reference.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    if stop is not None:  # a stop string spanning into the output's middle: the text after its 3rd character
        stop = full.text[3:5]
    ref = served.reference.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True, stop=stop))[0]
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}, stop=stop)
    whole = client.completions.create(**kw)
    assert whole.choices[0].text == ref.text
    assert whole.choices[0].finish_reason == ref.finish_reason
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert whole.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)
    served.wait_idle()


def test_chat_whole_and_streamed_match_llm_chat(served: Served) -> None:
    client = served.client()
    ref = served.reference.chat(MESSAGES, SamplingParams(max_tokens=20, ignore_eos=True))[0]
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].message.content == ref.text
    assert whole.choices[0].message.role == "assistant"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ref.prompt_token_ids), 20)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"
    served.wait_idle()


def test_seeded_sampling_reproducible_and_n(served: Served) -> None:
    client = served.client()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=7, n=2,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    ref = served.reference.generate(PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=2,
                                                           ignore_eos=True))[0]
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert texts == [o.text for o in ref.outputs]
    assert a.usage.completion_tokens == 32
    streamed = list(client.completions.create(stream=True, **kw))
    for k in range(2):
        assert "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == k) == texts[k]
    served.wait_idle()


def _post(served: Served, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(served.url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


BAD = [
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=600), "max_tokens"),
    ("/v1/completions", dict(prompt="word " * 600), "prompt"),
    ("/v1/completions", dict(prompt=PROMPT, temperature=-1), "temperature"),
    ("/v1/completions", dict(prompt=PROMPT, top_p=1.5), "top_p"),
    ("/v1/completions", dict(prompt=""), "prompt"),
    ("/v1/completions", dict(prompt=PROMPT, n=0), "n"),
    ("/v1/chat/completions", dict(messages=[]), "messages"),
    ("/v1/chat/completions", dict(messages=[{"content": "hi"}]), "messages"),
    ("/v1/completions", dict(model="other", prompt=PROMPT), "model"),
    ("/v1/completions", dict(model="", prompt=PROMPT), "model"),
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=0), "max_tokens"),
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=2.5), "max_tokens"),
    ("/v1/chat/completions", dict(messages=MESSAGES, max_completion_tokens=600), "max_completion_tokens"),
    ("/v1/completions", dict(prompt=PROMPT, temperature="hot"), "temperature"),
    ("/v1/completions", dict(prompt=[5, 10**9]), "prompt"),
    ("/v1/completions", dict(prompt=PROMPT, stream="yes"), "stream"),
    ("/v1/completions", dict(prompt=PROMPT, stream=True, stream_options={"include_usage": 1}),
     "stream_options.include_usage"),
    ("/v1/completions", dict(prompt=PROMPT, stop=[1, 2]), "stop"),
    ("/v1/chat/completions", dict(messages="hello"), "messages"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": 5}]), "messages"),
    ("/v1/completions", dict(prompt=PROMPT, logprobs=30), "logprobs"),
    ("/v1/completions", dict(prompt=PROMPT, presence_penalty=2.5), "presence_penalty"),
    ("/v1/completions", dict(prompt=PROMPT, repetition_penalty=0), "repetition_penalty"),
    ("/v1/chat/completions", dict(messages=MESSAGES, logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/chat/completions", dict(messages=MESSAGES, top_logprobs=2), "top_logprobs"),
    ("/v1/chat/completions", dict(messages=MESSAGES, logprobs=1), "logprobs"),
    # vLLM's fields: bad values, and known fields this server does not implement at a value other than neutral
    ("/v1/completions", dict(prompt=PROMPT, max_tokens=4, min_tokens=5), "min_tokens"),
    ("/v1/completions", dict(prompt=PROMPT, min_tokens=-1), "min_tokens"),
    ("/v1/chat/completions", dict(messages=MESSAGES, min_tokens="3"), "min_tokens"),
    ("/v1/completions", dict(prompt=PROMPT, top_k=-2), "top_k"),
    ("/v1/completions", dict(prompt=PROMPT, skip_special_tokens="no"), "skip_special_tokens"),
    ("/v1/completions", dict(prompt=PROMPT, include_stop_str_in_output=1), "include_stop_str_in_output"),
    ("/v1/completions", dict(prompt=PROMPT, spaces_between_special_tokens=0), "spaces_between_special_tokens"),
    ("/v1/completions", dict(prompt=PROMPT, echo="yes"), "echo"),
    ("/v1/completions", dict(prompt=PROMPT, echo=True, logprobs=1), "echo"),
    ("/v1/completions", dict(prompt=[]), "prompt"),
    ("/v1/completions", dict(prompt=[[]]), "prompt"),
    ("/v1/completions", dict(prompt=[PROMPT, 5]), "prompt"),
    ("/v1/completions", dict(prompt=[PROMPT, ""]), "prompt"),
    ("/v1/completions", dict(prompt=[PROMPT, "word " * 600]), "prompt"),
    ("/v1/completions", dict(prompt=[[5], [6] * 500], max_tokens=20), "max_tokens"),
    ("/v1/completions", dict(prompt=PROMPT, logit_bias={"5": 10}), "logit_bias"),
    ("/v1/completions", dict(prompt=PROMPT, best_of=3), "best_of"),
    ("/v1/completions", dict(prompt=PROMPT, suffix="}"), "suffix"),
    ("/v1/completions", dict(prompt=PROMPT, use_beam_search=True), "use_beam_search"),
    ("/v1/completions", dict(prompt=PROMPT, request_id=5), "request_id"),
    ("/v1/chat/completions", dict(messages=MESSAGES, echo=True), "echo"),
    ("/v1/chat/completions", dict(messages=MESSAGES, tools=[{"type": "function", "function": {"name": "f"}}]),
     "tools"),
    ("/v1/chat/completions", dict(messages=MESSAGES, continue_final_message=True), "continue_final_message"),
]


@pytest.mark.parametrize("path,body,field", BAD, ids=[f for _, _, f in BAD])
def test_bad_request_is_400_naming_the_field(served: Served, path: str, body: dict, field: str) -> None:
    status, err = _post(served, path, json.dumps({"model": MODEL, **body}).encode())
    assert status == 400, err
    assert err["error"]["param"] == field and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"]
    served.wait_idle()


def test_malformed_json_unknown_model_and_streamed_bad_requests(served: Served) -> None:
    for body in (b'{"model": "tiny", "prompt": ', b"[1, 2]", b"\xff\xfe"):
        status, err = _post(served, "/v1/completions", body)
        assert status == 400 and err["error"]["type"] == "invalid_request_error", err
    assert "JSON" in _post(served, "/v1/completions", b"{")[1]["error"]["message"]
    client = served.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="other", prompt=PROMPT, max_tokens=4)
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:  # refused before any event is streamed
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-0.5, stream=True)
    assert info.value.body["param"] == "temperature"
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).usage.completion_tokens > 0
    neutral = dict(presence_penalty=0, frequency_penalty=0.0, extra_body={"repetition_penalty": 1.0})
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, logprobs=False,
                                          **neutral).usage.completion_tokens == 2
    assert client.chat.completions.create(model=MODEL, max_tokens=3, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What does"}, {"type": "text", "text": " it do?"}]}]
    ).usage.completion_tokens > 0
    served.wait_idle()


def test_closed_stream_aborts_and_frees_its_kv(served: Served) -> None:
    client = served.client()
    aborted, steps = served.engine.num_aborted, served.llm.num_steps
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=480, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += 1
        if got == 3:
            break
    stream.close()
    served.wait_idle()
    assert served.llm.kv_cache.available_tokens == served.fresh_kv_tokens
    assert served.engine.num_aborted == aborted + 1  # dropped, not run to its 480 tokens
    assert served.llm.num_steps - steps < 480


def test_concurrent_streaming_load(served: Served) -> None:
    async def one_client(client: openai.AsyncOpenAI, k: int) -> int:
        n = 0
        for j in range(6):
            stream = await client.completions.create(model=MODEL, prompt=f"{PROMPT} {k} {j}", max_tokens=8,
                                                     temperature=0.8, seed=k * 6 + j, stream=True,
                                                     extra_body={"ignore_eos": True},
                                                     stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.usage is not None:
                    n += chunk.usage.completion_tokens
        return n

    async def main() -> list[int]:
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none", timeout=30, max_retries=0)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one_client(client, k) for k in range(32))), 60)
        finally:
            await client.close()

    assert asyncio.run(main()) == [48] * 32  # 32 clients x 6 streamed requests x 8 tokens, no error
    served.wait_idle()


def test_overloaded_is_503_with_retry_after(served: Served) -> None:
    """Two long streams fill a queue of two; a third request gets 503 with Retry-After at once; once they are
    closed, requests are served again and the KV pool is fresh."""
    limit = served.engine.max_pending
    served.engine.max_pending = 2
    client = served.client()
    streams = []
    try:
        for _ in range(2):
            streams.append(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, stream=True,
                                                     extra_body={"ignore_eos": True}))
            next(iter(streams[-1]))  # admitted and generating
        req = urllib.request.Request(served.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": MODEL, "prompt": PROMPT}).encode())
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        assert info.value.code == 503 and int(info.value.headers["Retry-After"]) >= 1
        assert "max_pending" in json.loads(info.value.read())["error"]["message"]
    finally:
        for s in streams:
            s.close()
        served.wait_idle()
        served.engine.max_pending = limit
    assert served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens
    served.wait_idle()


def test_serve_subcommand_checks_options() -> None:
    from compile_attn.cli import build_parser

    args = build_parser().parse_args(["serve", "some/model", "--port", "70000"])
    with pytest.raises(ValueError, match="--port"):
        args.prepare(args)
    args = build_parser().parse_args(["serve", "some/model", "--max-batch-size", "4", "--no-compile"])
    args.prepare(args)
    assert (args.host, args.port, args.max_batch_size, args.no_compile) == ("127.0.0.1", 8000, 4, True)


def test_chat_n_seeded_streamed_with_usage(served: Served) -> None:
    """n = 2 seeded chat samples: whole, streamed (with the usage chunk) and LLM.chat agree sample by sample; usage
    counts the prompt once and every sample's tokens; without include_usage no chunk carries usage."""
    client = served.client()
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0.9, seed=123, n=2,
              extra_body={"ignore_eos": True, "top_k": 50})
    ref = served.reference.chat(MESSAGES, SamplingParams(max_tokens=10, temperature=0.9, top_k=50, seed=123, n=2,
                                                         ignore_eos=True))[0]
    want = [o.text for o in ref.outputs]
    assert want[0] != want[1]
    whole = client.chat.completions.create(**kw)
    assert [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)] == want
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ref.prompt_token_ids), 20)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(ref.prompt_token_ids), 20)
    for k in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == k]
        assert "".join(c.delta.content or "" for c in mine) == want[k]
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    plain = list(client.chat.completions.create(stream=True, **kw))
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)
    served.wait_idle()


def test_return_token_ids_whole_and_streamed(served: Served) -> None:
    """vLLM's return_token_ids: each choice (and chunk) carries its output token ids, those generate returns."""
    ref = served.reference.generate(PROMPT, SamplingParams(max_tokens=7, ignore_eos=True))[0]
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0, ignore_eos=True, return_token_ids=True)
    status, whole = _post(served, "/v1/completions", json.dumps(body).encode())
    assert status == 200 and whole["choices"][0]["token_ids"] == ref.token_ids
    chunks = list(served.client().completions.create(stream=True, extra_body={"ignore_eos": True,
                                                                              "return_token_ids": True},
                                                     **{k: body[k] for k in ("model", "prompt", "max_tokens",
                                                                             "temperature")}))
    assert [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids", [])] == ref.token_ids
    served.wait_idle()


def test_logprobs_and_penalties_match_generate(served: Served) -> None:
    """Completions with logprobs and penalties, whole and streamed, give the reference LLM's tokens and logprobs;
    chat's logprobs carry the same values in chat's shape."""
    client = served.client()
    sp = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, presence_penalty=0.4, frequency_penalty=0.6,
                        repetition_penalty=1.3)
    ref = served.reference.generate(PROMPT, sp)[0].outputs[0]
    plain = served.reference.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert ref.token_ids != plain.token_ids, "the penalties were meant to change the output"
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2, presence_penalty=0.4,
              frequency_penalty=0.6, extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    whole = client.completions.create(**kw).choices[0]
    assert whole.text == ref.text
    want = [lp[t].logprob for t, lp in zip(ref.token_ids, ref.logprobs)]
    assert whole.logprobs.token_logprobs == pytest.approx(want, abs=1e-6)
    assert all(len(top) == 2 for top in whole.logprobs.top_logprobs)
    for top, lp in zip(whole.logprobs.top_logprobs, ref.logprobs):
        best = sorted(((e.rank, e.logprob) for t, e in lp.items() if e.rank <= 2))
        assert sorted(top.values(), reverse=True)[:len(best)] == pytest.approx([v for _, v in best], abs=1e-6)
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert "".join(c.text for c in chunks) == ref.text and streamed == pytest.approx(want, abs=1e-6)
    chat_ref = served.reference.chat(MESSAGES, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))[0]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    got = [c.logprob for c in chat.logprobs.content]
    assert got == pytest.approx([lp[t].logprob for t, lp in zip(chat_ref.token_ids, chat_ref.outputs[0].logprobs)],
                                abs=1e-6)
    assert all(len(c.top_logprobs) == 2 for c in chat.logprobs.content)
    served.wait_idle()


# ------------------------------------------------------------------------------ vLLM's request fields
def _tokenizer(served: Served):
    return served.reference.tokenizer


def test_a_list_of_prompts_gives_n_choices_per_prompt(served: Served) -> None:
    """A list of prompt strings, and of token-id lists: choice ``i * n + k`` is sample ``k`` of prompt ``i``, each
    equal to the reference LLM's sample of that prompt; usage counts every prompt once and every sample; the stream
    carries the same texts under the same indices."""
    client = served.client()
    prompts = [PROMPT, "def f(x):", "import os"]
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=2, ignore_eos=True)
    ref = served.reference.generate(prompts, sp)
    want = [o.text for r in ref for o in r.outputs]
    prompt_tokens = sum(len(r.prompt_token_ids) for r in ref)
    kw = dict(model=MODEL, max_tokens=6, temperature=1.0, seed=11, n=2, extra_body={"ignore_eos": True})
    ids = [_tokenizer(served)(p)["input_ids"] for p in prompts]
    for prompt in (prompts, ids):
        whole = client.completions.create(prompt=prompt, **kw)
        assert sorted(c.index for c in whole.choices) == list(range(6))
        assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == want
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 6 * 6)
        chunks = list(client.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True},
                                                **kw))
        for j in range(6):
            assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == j) == want[j]
        assert chunks[-1].usage.prompt_tokens == prompt_tokens
    served.wait_idle()


def test_echo_prepends_the_prompt(served: Served) -> None:
    """echo: each choice's text is its prompt's text (the string sent; for token ids their decode) followed by the
    completion, whole and streamed."""
    client = served.client()
    tok = _tokenizer(served)
    ids = tok("import os")["input_ids"]
    refs = served.reference.generate([PROMPT, ids], SamplingParams(max_tokens=5, ignore_eos=True))
    prompt_texts = [PROMPT, tok.decode(ids, skip_special_tokens=True)]
    assert prompt_texts[1] == "import os"
    kw = dict(model=MODEL, prompt=[PROMPT, ids], max_tokens=5, temperature=0, echo=True,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    texts = [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert texts == [p + r.text for p, r in zip(prompt_texts, refs)]
    chunks = list(client.completions.create(stream=True, **kw))
    assert ["".join(c.choices[0].text for c in chunks if c.choices[0].index == j) for j in range(2)] == texts
    served.wait_idle()


def test_top_k_minus_one_is_off_and_model_may_be_left_out(served: Served) -> None:
    """vLLM's top_k=-1 samples as no top-k does; a body without ``model`` (or with null) is served by the served
    model."""
    ref = served.reference.generate(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True))[0]
    got = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5,
                                             extra_body={"top_k": -1, "ignore_eos": True})
    assert got.choices[0].text == ref.text
    for body in ({}, {"model": None}):
        status, out = _post(served, "/v1/completions", json.dumps(
            {**body, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 5, "top_k": -1,
             "ignore_eos": True}).encode())
        assert status == 200 and out["choices"][0]["text"] == ref.text and out["model"] == MODEL
    status, out = _post(served, "/v1/chat/completions", json.dumps({"messages": MESSAGES, "max_tokens": 3}).encode())
    assert status == 200 and out["usage"]["completion_tokens"] >= 1
    served.wait_idle()


def test_min_tokens_holds_eos_and_stop_tokens_back(served: Served) -> None:
    """min_tokens: a prompt whose greedy answer is EOS at once gets at least min_tokens tokens before any EOS (the
    token count and the token ids say so), whole and streamed; a stop token id the answer holds early cannot end it
    before min_tokens either, and ends it after; a stop string found early is passed over too."""
    client = served.client()
    eos = _tokenizer(served).eos_token_id
    first = served.reference.generate("def f(x):", SamplingParams(max_tokens=20))[0]
    assert first.finish_reason == "stop" and first.token_ids == [eos], "the prompt was meant to end at once"
    for stream in (False, True):
        kw = dict(model=MODEL, prompt="def f(x):", max_tokens=30, temperature=0, stream=stream,
                  extra_body={"min_tokens": 10, "return_token_ids": True})
        if stream:
            chunks = [c.choices[0] for c in client.completions.create(**kw)]
            ids = [t for c in chunks for t in (c.model_extra or {}).get("token_ids", [])]
            finish = chunks[-1].finish_reason
        else:
            choice = client.completions.create(**kw).choices[0]
            ids, finish = choice.model_extra["token_ids"], choice.finish_reason
        assert len(ids) > 10 and eos not in ids[:10]
        assert finish == "length" or (finish == "stop" and ids[-1] == eos)
    # a stop token id the min_tokens answer holds at index 2: not before 10 tokens
    base = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=30, temperature=0,
                                     extra_body={"min_tokens": 10, "return_token_ids": True,
                                                 "ignore_eos": True}).choices[0].model_extra["token_ids"]
    stop_id = base[2]
    out = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=30, temperature=0,
                                    extra_body={"min_tokens": 10, "return_token_ids": True, "ignore_eos": True,
                                                "stop_token_ids": [stop_id]}).choices[0]
    ids = out.model_extra["token_ids"]
    assert stop_id not in ids[:10] and len(ids) > 10
    if out.finish_reason == "stop":
        assert ids[-1] == stop_id and out.model_extra["stop_reason"] == stop_id
    # a stop string the plain answer holds within its first tokens is passed over until min_tokens
    plain = served.reference.generate(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop = plain.text[2:5]
    early = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=stop,
                                               extra_body={"ignore_eos": True})
    assert early.usage.completion_tokens < 12, "the stop string was meant to end the plain answer early"
    late = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=stop,
                                              extra_body={"ignore_eos": True, "min_tokens": 12})
    assert late.usage.completion_tokens > 12
    served.wait_idle()


def test_stop_reason_and_include_stop_str_in_output(served: Served) -> None:
    """stop_reason: the stop string or token id that ended a choice (null for EOS and length), whole and streamed;
    include_stop_str_in_output keeps the stop string (or the stop token's text) at the end of the text, which is
    otherwise cut before it (the text of the plain answer, cut by hand, is the expected value)."""
    client = served.client()
    tok = _tokenizer(served)
    full = served.reference.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    stop = full.text[6:9]
    at = full.text.index(stop)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
    for include, want in ((False, full.text[:at]), (True, full.text[:at + len(stop)])):
        extra = {"ignore_eos": True, "include_stop_str_in_output": include}
        whole = client.completions.create(extra_body=extra, **kw).choices[0]
        assert (whole.text, whole.finish_reason, whole.model_extra["stop_reason"]) == (want, "stop", stop)
        chunks = [c.choices[0] for c in client.completions.create(stream=True, extra_body=extra, **kw)]
        assert "".join(c.text for c in chunks) == want
        assert [(c.finish_reason, c.model_extra["stop_reason"]) for c in chunks][-1] == ("stop", stop)
        assert all(c.model_extra["stop_reason"] is None for c in chunks[:-1])
    stop_id = full.token_ids[4]
    ids = full.token_ids[:full.token_ids.index(stop_id) + 1]
    for include, want in ((False, tok.decode(ids[:-1], skip_special_tokens=True)),
                          (True, tok.decode(ids, skip_special_tokens=True))):
        extra = {"ignore_eos": True, "stop_token_ids": [stop_id], "include_stop_str_in_output": include,
                 "return_token_ids": True}
        choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                           extra_body=extra).choices[0]
        assert (choice.text, choice.model_extra["token_ids"]) == (want, ids)
        assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop_id)
    eos_end = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0)
    assert eos_end.choices[0].model_extra["stop_reason"] is None
    served.wait_idle()


def test_skip_special_tokens(served: Served) -> None:
    """skip_special_tokens=false keeps EOS (sampled here at once, then passed over with ignore_eos) in the text,
    as the tokenizer's own decode of the token ids writes it; the default leaves it out."""
    tok = _tokenizer(served)
    client = served.client()
    texts = {}
    for skip in (True, False):
        choice = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True, "skip_special_tokens": skip,
                                                       "return_token_ids": True,
                                                       "spaces_between_special_tokens": True}).choices[0]
        ids = choice.model_extra["token_ids"]
        assert ids[0] == tok.eos_token_id
        assert choice.text == tok.decode(ids, skip_special_tokens=skip)
        texts[skip] = choice.text
        streamed = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=6, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True,
                                                                      "skip_special_tokens": skip})
        assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert texts[False].startswith(tok.eos_token) and tok.eos_token not in texts[True]
    served.wait_idle()


def test_unknown_fields_are_ignored_and_neutral_unsupported_ones_accepted(served: Served, caplog,
                                                                         request: pytest.FixtureRequest) -> None:
    """A field the server does not know (``user``-like metadata, a newer vLLM option) is ignored, with a warning in
    the log of the process serving HTTP; a known field it does not implement passes at its neutral value."""
    ref = served.reference.generate(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))[0]
    with caplog.at_level(logging.WARNING, logger="compile_attn.server.protocol"):
        got = served.client().completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, user="someone", best_of=1, logit_bias={},
            suffix="", extra_body={"ignore_eos": True, "frobnicate": 1, "kv_transfer_params": None,
                                   "use_beam_search": False, "length_penalty": 1, "priority": 0})
    assert got.choices[0].text == ref.text
    if _front_end_in_this_process(request):
        assert any("frobnicate" in r.getMessage() and "kv_transfer_params" in r.getMessage()
                   for r in caplog.records)
    chat = served.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, tools=[],
                                                   tool_choice="none", parallel_tool_calls=False,
                                                   extra_body={"echo": False, "chat_template_kwargs": {}})
    assert chat.usage.completion_tokens == 2
    served.wait_idle()


def _front_end_in_this_process(request: pytest.FixtureRequest) -> bool:
    """Whether ``served``'s HTTP front end is a thread of this process (its log records then reach caplog)."""
    return request.node.callspec.params.get("served") == "thread"


def test_each_finished_request_is_logged_at_info(served: Served, caplog, request: pytest.FixtureRequest) -> None:
    """One INFO line per finished request: its id, prompt and output tokens, latency and finish reasons (in this
    process when the front end is a thread of it)."""
    if not _front_end_in_this_process(request):
        pytest.skip("the front end's log is its own process's")
    with caplog.at_level(logging.INFO, logger="compile_attn.server.app"):
        whole = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2,
                                                   extra_body={"ignore_eos": True})
        list(served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True,
                                                extra_body={"ignore_eos": True, "request_id": "mine-1"}))
    lines = [r.getMessage() for r in caplog.records if r.name == "compile_attn.server.app"]
    n_prompt = whole.usage.prompt_tokens
    assert any(m.startswith(f"{whole.id}: {n_prompt} prompt + 8 output tokens in ") and
               m.endswith("finish length,length") for m in lines), lines
    assert any(m.startswith(f"cmpl-mine-1: {n_prompt} prompt + 3 output tokens in ") for m in lines), lines
    served.wait_idle()


# ------------------------------------------------------------------------------ introspection
def test_tokenize_detokenize_version_and_openapi(served: Served) -> None:
    """vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize against the tokenizer
    called directly; /version; /openapi.json describes every request body (and /docs serves)."""
    import httpx

    import compile_attn

    tok = _tokenizer(served)
    with httpx.Client(base_url=served.url, timeout=30, trust_env=False) as http:
        r = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})
        want = tok("hello world")["input_ids"]
        assert r.status_code == 200 and r.json() == {"count": len(want), "max_model_len": 512, "tokens": want,
                                                     "token_strs": tok.convert_ids_to_tokens(want)}
        r = http.post("/tokenize", json={"model": MODEL, "prompt": "hello world", "add_special_tokens": False})
        assert r.json()["tokens"] == tok("hello world", add_special_tokens=False)["input_ids"] != want
        assert "token_strs" not in r.json()
        text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        r = http.post("/tokenize", json={"messages": MESSAGES})
        assert r.json()["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
        text = tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
        r = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})
        assert r.json()["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
        r = http.post("/detokenize", json={"tokens": want})
        assert r.status_code == 200 and r.json() == {"prompt": tok.decode(want)}
        for path, body, param in (("/tokenize", {"prompt": 5}, "prompt"), ("/detokenize", {"tokens": [-1]}, "tokens"),
                                  ("/detokenize", {"tokens": [10**9]}, "tokens"),
                                  ("/tokenize", {"prompt": "x", "model": "other"}, "model")):
            r = http.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert http.get("/version").json() == {"version": compile_attn.__version__}
        doc = http.get("/openapi.json").json()
        schemas = doc["components"]["schemas"]
        for path, names in (("/v1/completions", ["CompletionRequest"]), ("/v1/chat/completions",
                                                                         ["ChatCompletionRequest"]),
                            ("/tokenize", ["TokenizeCompletionRequest", "TokenizeChatRequest"]),
                            ("/detokenize", ["DetokenizeRequest"])):
            body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            refs = [body["$ref"]] if "$ref" in body else [b["$ref"] for b in body["anyOf"]]
            assert refs == [f"#/components/schemas/{n}" for n in names]
            for name in names:
                assert name in schemas
        fields = schemas["CompletionRequest"]["properties"]
        for name in ("prompt", "echo", "min_tokens", "top_k", "skip_special_tokens", "include_stop_str_in_output",
                     "stop_token_ids", "logit_bias"):
            assert name in fields and fields[name].get("description") or name == "prompt", name
        assert "messages" in schemas["ChatCompletionRequest"]["required"]
        assert http.get("/docs").status_code == 200
    served.wait_idle()
