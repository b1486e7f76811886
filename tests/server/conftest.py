"""A real uvicorn server on 127.0.0.1 (a free port, a background thread) serving a briefly trained tiny Llama on the
CPU, the engine behind it, and a reference LLM on the same model to compare outputs with."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")


from compile_attn.engine import LLM  # noqa: E402
from compile_attn.engine.serving.async_engine import AsyncLLM  # noqa: E402
from compile_attn.server.frontend import FRONTENDS, serving  # noqa: E402

ENGINE = dict(max_batch_size=8, max_num_tokens=256, kv_cache_tokens=4096, max_context=512, page_size=4,
              graph_mode="none", compile=False, device="cpu")
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MODEL = "tiny"


@dataclass
class Served:
    url: str
    engine: AsyncLLM
    llm: LLM
    reference: LLM
    fresh_kv_tokens: int

    def client(self, **kw: object) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=30, max_retries=0, **kw)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until nothing is pending and the KV pool is back to fresh (AssertionError otherwise)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if (self.engine.num_pending == 0 and self.llm.kv_cache.available_tokens == self.fresh_kv_tokens):
                return
            time.sleep(0.02)
        raise AssertionError(f"not idle: {self.engine.num_pending} pending, "
                             f"{self.llm.kv_cache.available_tokens} of {self.fresh_kv_tokens} KV tokens free")


def _llm(path: str, options: dict[str, Any] | None = None) -> LLM:
    llm = LLM(path, **{**ENGINE, **(options or {})})
    llm.tokenizer.chat_template = TEMPLATE
    return llm


@pytest.fixture(scope="module")
def engine_options() -> dict[str, Any]:
    """Engine options beyond ENGINE for ``served``'s LLM and its reference; a test module overrides this fixture to
    serve another engine (e.g. ``{"kv_cache_dtype": "fp8_e4m3"}``)."""
    return {}


@pytest.fixture(scope="module", params=FRONTENDS)
def served(request: pytest.FixtureRequest, trained_tiny_llama: Callable[[int], Path],
           engine_options: dict[str, Any]) -> Iterator[Served]:
    """The server with its HTTP front end in a process of its own (as ``compile-attn serve`` runs it) and in a
    thread of the engine's process (the app on an AsyncLLM, as a library user may embed it)."""
    path = str(trained_tiny_llama(60))
    llm, reference = _llm(path, engine_options), _llm(path, engine_options)
    engine = AsyncLLM(llm, max_pending=64)
    try:
        with serving(engine, MODEL, request.param) as front:
            yield Served(front.url, engine, llm, reference, llm.kv_cache.available_tokens)
    finally:
        engine.shutdown()
