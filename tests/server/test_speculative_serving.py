"""The server on an engine with speculative decoding (prompt lookup): a streamed completion carries every accepted
token (several per chunk where a verify step accepts drafts) and equals plain generation; /metrics counts the
drafts verified and accepted; min_tokens holds a stop token back in verify steps as in plain decoding."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from compile_attn.engine import LLM, SamplingParams
from compile_attn.engine.serving.async_engine import AsyncLLM
from compile_attn.server.frontend import serving
from tests.server.conftest import ENGINE, MODEL, TEMPLATE, Served
from tests.server.test_metrics import scrape

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def served_spec(trained_tiny_llama: Callable[[int], Path]) -> Iterator[Served]:
    path = str(trained_tiny_llama(60))
    llm, reference = LLM(path, speculative_config=NGRAM, **ENGINE), LLM(path, **ENGINE)
    llm.tokenizer.chat_template = TEMPLATE
    engine = AsyncLLM(llm, max_pending=16)
    try:
        with serving(engine, MODEL, "thread") as front:
            yield Served(front.url, engine, llm, reference, llm.kv_cache.available_tokens)
    finally:
        engine.shutdown()


def test_streamed_tokens_equal_plain_generation_and_metrics_count_drafts(served_spec: Served) -> None:
    prompt = "The list of the list of the list of the"
    (ref,) = served_spec.reference.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))
    before = scrape(served_spec)
    chunks = list(served_spec.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[-1].usage.completion_tokens == 24
    after = scrape(served_spec)
    accepted = after["compile_attn_spec_decode_num_accepted_tokens"] - before["compile_attn_spec_decode_num_accepted_tokens"]
    drafts = after["compile_attn_spec_decode_num_draft_tokens"] - before["compile_attn_spec_decode_num_draft_tokens"]
    assert 0 < accepted <= drafts
    text_chunks = [c for c in chunks if c.choices and c.choices[0].text]
    assert len(text_chunks) < 24  # accepted drafts arrive several tokens to a chunk
    served_spec.wait_idle()


def test_min_tokens_with_drafts(served_spec: Served) -> None:
    """min_tokens on an engine that verifies drafts: a repetitive answer (prompt lookup drafts its repeats) whose
    most frequent token is made a stop token. Before min_tokens the stop token must be kept out of every row a
    verify step samples, or a draft of it would be accepted. The answer has more than min_tokens tokens, none of them
    the stop token among the first min_tokens, and equals plain generation's (no speculation) with the same
    parameters, whole and streamed."""
    prompt = "The list of the list of the list of the"
    plain = served_spec.reference.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True))[0].token_ids
    stop_id = max(set(plain[:20]), key=plain[:20].count)
    assert plain[:20].count(stop_id) >= 2, "the answer was meant to repeat the stop token early"
    sp = SamplingParams(max_tokens=40, min_tokens=20, ignore_eos=True, stop_token_ids=[stop_id])
    ref = served_spec.reference.generate(prompt, sp)[0]
    drafted = served_spec.llm.speculator.stats.draft_tokens
    client = served_spec.client()
    kw = dict(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
              extra_body={"min_tokens": 20, "ignore_eos": True, "stop_token_ids": [stop_id], "return_token_ids": True})
    whole = client.completions.create(**kw).choices[0]
    got = whole.model_extra["token_ids"]
    assert len(got) > 20 and stop_id not in got[:20]
    assert whole.finish_reason == "length" or (got[-1] == stop_id and whole.model_extra["stop_reason"] == stop_id)
    assert got == ref.token_ids and whole.text == ref.text
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
    assert [t for c in chunks for t in (c.model_extra or {}).get("token_ids", [])] == ref.token_ids
    assert served_spec.llm.speculator.stats.draft_tokens > drafted  # drafts were verified
    served_spec.wait_idle()
