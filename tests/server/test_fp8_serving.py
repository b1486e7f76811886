"""The server on an engine with an fp8 KV cache, with its front end in the engine's process and in its own:
/v1/models reports the KV cache dtype, and a completion equals an fp8 LLM's plain generation (both calibrate their
scales on the same first prompt)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from tests.server.conftest import MODEL, Served

from compile_attn.engine import SamplingParams

PROMPT = "The list of the function returns"


@pytest.fixture(scope="module")
def engine_options() -> dict[str, Any]:
    """``served`` (tests/server/conftest.py) on an fp8 KV cache."""
    return {"kv_cache_dtype": "fp8_e4m3"}


def test_models_report_the_kv_cache_dtype_and_completions_match_generation(served: Served) -> None:
    with urllib.request.urlopen(served.url + "/v1/models", timeout=10) as r:
        (model,) = json.load(r)["data"]
    assert model["id"] == MODEL and model["kv_cache_dtype"] == "fp8_e4m3"
    (ref,) = served.reference.generate([PROMPT], SamplingParams(max_new_tokens=16, ignore_eos=True))
    done = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert done.choices[0].text == ref.text and done.usage.completion_tokens == 16
    served.wait_idle()
