"""The front end in its own process: a front end that dies mid-stream has its requests aborted by the engine (KV
fresh, nothing pending) and the engine goes on serving a new front end."""

from __future__ import annotations

import json
import multiprocessing

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from compile_attn.engine.serving.async_engine import AsyncLLM  # noqa: E402
from compile_attn.server.frontend import serve_in_process  # noqa: E402
from tests.engine.serving.test_async_engine import PROMPTS, toy_llm, wait_idle  # noqa: E402


def test_dead_front_end_aborts_its_requests() -> None:
    engine = AsyncLLM(toy_llm(), max_pending=8)
    engine.fresh_kv_tokens = engine.llm.kv_cache.available_tokens
    try:
        with serve_in_process(engine, "toy") as served:
            url = served.url
            (front,) = [p for p in multiprocessing.active_children() if p.name == "compile-attn-frontend"]
            body = {"model": "toy", "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True,
                    "return_token_ids": True}  # a model without a tokenizer makes no text: chunks carry ids
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                first = next(line for line in r.iter_lines() if line.startswith("data: "))
                assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
                assert engine.num_pending == 1
                front.kill()
                front.join(10)
            wait_idle(engine)
            assert engine.num_aborted == 1
        with serve_in_process(engine, "toy") as served:  # a new front end on the same engine
            url = served.url
            r = httpx.post(url + "/v1/completions", json={"model": "toy", "prompt": PROMPTS[1], "max_tokens": 5,
                                                         "ignore_eos": True}, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            wait_idle(engine)
    finally:
        engine.shutdown()
