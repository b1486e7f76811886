"""The OpenAI-compatible server driven by the official ``openai`` client over loopback: completions and chat, whole
and streamed, against a separate LLM's ``generate`` / ``chat`` on the same model; stop strings, seeds, n, usage;
every refused request (400 naming the field); aborted streams and a concurrent load leave the KV pool fresh."""

from __future__ import annotations

import asyncio
import json
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
    ("/v1/completions", dict(prompt=PROMPT, frobnicate=1), "frobnicate"),
    ("/v1/chat/completions", dict(messages=[]), "messages"),
    ("/v1/chat/completions", dict(messages=[{"content": "hi"}]), "messages"),
    ("/v1/completions", dict(model="other", prompt=PROMPT), "model"),
    ("/v1/completions", dict(model=None, prompt=PROMPT), "model"),
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
