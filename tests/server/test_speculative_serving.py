"""The server on an engine with speculative decoding (prompt lookup): a streamed completion carries every accepted
token (several per chunk where a verify step accepts drafts) and equals plain generation; /metrics counts the
drafts verified and accepted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.conftest import ENGINE, MODEL, TEMPLATE, Served
from tests.server.test_metrics import scrape

from compile_attn.engine import LLM, SamplingParams
from compile_attn.engine.serving.async_engine import AsyncLLM
from compile_attn.models.tiny_llama import tiny_llama
from compile_attn.server.frontend import serving

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def served_spec(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = str(tiny_llama(tmp_path_factory.mktemp("tiny") / "model", steps=60))
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
