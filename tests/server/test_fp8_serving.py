"""The server on an engine with an fp8 KV cache, with its front end in the engine's process and in its own:
/v1/models reports the KV cache dtype, and a completion equals an fp8 LLM's plain generation (both calibrate their
scales on the same first prompt)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import pytest

from tests.server.conftest import ENGINE, MODEL, Served

from compile_attn.engine import LLM, SamplingParams
from compile_attn.engine.serving.async_engine import AsyncLLM
from compile_attn.models.tiny_llama import tiny_llama
from compile_attn.server.frontend import FRONTENDS, serving

PROMPT = "The list of the function returns"


@pytest.fixture(scope="module", params=FRONTENDS)
def served_fp8(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = str(tiny_llama(tmp_path_factory.mktemp("tiny") / "model", steps=60))
    llm, reference = (LLM(path, kv_cache_dtype="fp8_e4m3", **ENGINE) for _ in range(2))
    engine = AsyncLLM(llm, max_pending=16)
    try:
        with serving(engine, MODEL, request.param) as front:
            yield Served(front.url, engine, llm, reference, llm.kv_cache.available_tokens)
    finally:
        engine.shutdown()


def test_models_report_the_kv_cache_dtype_and_completions_match_generation(served_fp8: Served) -> None:
    with urllib.request.urlopen(served_fp8.url + "/v1/models", timeout=10) as r:
        (model,) = json.load(r)["data"]
    assert model["id"] == MODEL and model["kv_cache_dtype"] == "fp8_e4m3"
    (ref,) = served_fp8.reference.generate([PROMPT], SamplingParams(max_new_tokens=16, ignore_eos=True))
    done = served_fp8.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                                  extra_body={"ignore_eos": True})
    assert done.choices[0].text == ref.text and done.usage.completion_tokens == 16
    served_fp8.wait_idle()
