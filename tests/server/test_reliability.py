"""The server under load and at shutdown, both front-end placements, on a toy model (token ids in, token ids out):

- a burst of 64 concurrent streams with long prompts (together more than a pipe's buffer), half of the clients
  going away mid-stream: no 5xx, every kept stream whole and equal to a separate LLM's greedy output;
- a graceful stop with streams and whole requests open: no new connections; those that finish within the shutdown
  timeout end normally, the others end with a last chunk (finish_reason "abort") and [DONE] or a 503 with OpenAI's
  error body; the engine serves a new front end afterwards with the same answers;
- /metrics after every client went away: nothing running, waiting or pending, no KV in use, the samples counted as
  aborted; the KV capacity is known before the first request.

After each the engine is idle with every KV slot free.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("zmq")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from compile_attn.engine import LLM, SamplingParams  # noqa: E402
from compile_attn.engine.serving.async_engine import AsyncLLM  # noqa: E402
from compile_attn.models import ToyDecoder  # noqa: E402
from compile_attn.server.frontend import FRONTENDS, serving  # noqa: E402
from tests.engine.serving.test_async_engine import CFG as SMALL, wait_idle  # noqa: E402

import dataclasses  # noqa: E402

import torch  # noqa: E402

# ids up to 70,000 pickle to 5 bytes each: 64 prompts of ~1,000 tokens are ~320 KB of commands at once
CFG = dataclasses.replace(SMALL, vocab_size=70_000)

ENGINE = dict(max_batch_size=8, max_num_tokens=2048, kv_cache_tokens=32768, max_context=4096, page_size=4,
              graph_mode="none", compile=False, device="cpu")


def _toy() -> LLM:
    torch.manual_seed(0)
    return LLM(ToyDecoder(CFG).eval(), **ENGINE)


@pytest.fixture(scope="module")
def reference() -> LLM:
    return _toy()


@pytest.fixture(params=FRONTENDS)
def frontend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def engine() -> Iterator[AsyncLLM]:
    eng = AsyncLLM(_toy(), max_pending=256)
    eng.fresh_kv_tokens = eng.llm.kv_cache.available_tokens
    yield eng
    eng.shutdown()


def _body(prompt: list[int], max_tokens: int, stream: bool = True) -> dict:
    return {"model": "toy", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": stream, "return_token_ids": True}


async def _read_stream(client: httpx.AsyncClient, url: str, body: dict, *, stop_after: int | None = None) -> dict:
    """POST a streamed completion; read it whole (or go away after ``stop_after`` chunks): the status, the token ids,
    the last finish_reason, whether [DONE] came, any error event."""
    out = {"status": None, "ids": [], "finish": None, "done": False, "error": None, "chunks": 0}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = json.loads(await r.aread())
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk
                continue
            choice = chunk["choices"][0]
            out["ids"] += choice.get("token_ids") or []
            out["finish"] = choice["finish_reason"] or out["finish"]
            out["chunks"] += 1
            if stop_after is not None and out["chunks"] >= stop_after:
                return out  # leaving the block closes the connection mid-stream
    return out


def _prompt(k: int, length: int) -> list[int]:
    return [(k * 7919 + j * 104_729) % CFG.vocab_size for j in range(length)]


def test_burst_of_long_prompts_with_half_the_clients_leaving(engine: AsyncLLM, reference: LLM,
                                                             frontend: str) -> None:
    prompts = [_prompt(k, 1000 + k) for k in range(64)]
    new = 12
    expected = [o.token_ids for o in reference.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))]

    async def main(url: str) -> list[dict]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_read_stream(client, url, _body(p, new), stop_after=2 if k % 2 else None)
                                          for k, p in enumerate(prompts)))

    with serving(engine, "toy", frontend) as front:
        results = asyncio.run(asyncio.wait_for(main(front.url), 240))
        assert [r["status"] for r in results] == [200] * 64
        for k, r in enumerate(results):
            if k % 2 == 0:  # kept to the end: whole and right
                assert (r["ids"], r["finish"], r["done"], r["error"]) == (expected[k], "length", True, None), k
        wait_idle(engine)
        # the engine still answers, the same as before
        r = httpx.post(front.url + "/v1/completions", json=_body(prompts[1], new, stream=False), timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected[1]
    wait_idle(engine)


def test_graceful_stop_finishes_short_requests_and_ends_the_rest(engine: AsyncLLM, reference: LLM,
                                                                frontend: str) -> None:
    medium = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = [o.token_ids for o in reference.generate([_prompt(1, 8), _prompt(2, 8)], medium)]

    async def main(front) -> tuple:  # noqa: ANN001
        async with httpx.AsyncClient(timeout=60) as client:
            mediums = [asyncio.ensure_future(_read_stream(client, front.url, _body(_prompt(k, 8), 40)))
                       for k in (1, 2)]
            longs = [asyncio.ensure_future(_read_stream(client, front.url, _body(_prompt(k, 8), 4000)))
                     for k in range(3, 6)]
            wholes = [asyncio.ensure_future(client.post(front.url + "/v1/completions",
                                                        json=_body(_prompt(k, 8), 4000, stream=False)))
                      for k in range(6, 8)]
            end = time.monotonic() + 30
            while engine.num_pending < 7:  # every request admitted
                assert time.monotonic() < end, engine.num_pending
                await asyncio.sleep(0.005)
            front.request_stop()  # what SIGTERM does (in the front end's own process, or its thread)
            await asyncio.sleep(0.3)  # the listener closes on the server's loop
            try:
                async with httpx.AsyncClient(timeout=10) as fresh:  # a new client's new connection
                    late = (await fresh.get(front.url + "/health")).status_code
            except httpx.ConnectError:
                late = "refused"
            return (await asyncio.gather(*mediums), await asyncio.gather(*longs), await asyncio.gather(*wholes),
                    late)

    with serving(engine, "toy", frontend, shutdown_timeout=3.0) as front:
        mediums, longs, wholes, late = asyncio.run(asyncio.wait_for(main(front), 60))
        assert front.join(10), "the front end did not stop"
    assert late == "refused"
    for r, ids in zip(mediums, expected):  # finished within the timeout: as if nothing happened
        assert (r["status"], r["ids"], r["finish"], r["done"], r["error"]) == (200, ids, "length", True, None)
    for r in longs:  # ended at the timeout: a last chunk with finish_reason "abort", then [DONE]
        assert (r["status"], r["finish"], r["done"], r["error"]) == (200, "abort", True, None)
        assert 0 < len(r["ids"]) < 4000
    for r in wholes:
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
        assert "shutting down" in r.json()["error"]["message"]
    wait_idle(engine)
    # the engine goes on serving a new front end, with the same answers
    with serving(engine, "toy", frontend) as front:
        got = [httpx.post(front.url + "/v1/completions", json=_body(_prompt(k, 8), 40, stream=False),
                          timeout=60).json()["choices"][0]["token_ids"] for k in (1, 2)]
        assert got == expected
    wait_idle(engine)


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + (f"{{{s.labels['finished_reason']}}}" if "finished_reason" in s.labels else "")
            values[key] = values.get(key, 0.0) + s.value
    return values


def test_metrics_settle_after_every_client_left(engine: AsyncLLM, frontend: str) -> None:
    capacity = engine.gauges()["kv_capacity_tokens"]

    async def main(url: str) -> list[dict]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(_read_stream(client, url, _body(_prompt(k, 16), 4000), stop_after=1)
                                          for k in range(4)))

    with serving(engine, "toy", frontend) as front:
        first = _scrape(front.url)
        assert first["compile_attn_kv_cache_capacity_tokens"] == capacity > 0  # before any request
        results = asyncio.run(asyncio.wait_for(main(front.url), 60))
        assert [r["status"] for r in results] == [200] * 4
        end = time.monotonic() + 3  # within a second or so the gauges follow the engine
        while True:
            m = _scrape(front.url)
            settled = (m["compile_attn_num_requests_running"], m["compile_attn_num_requests_waiting"],
                       m["compile_attn_num_requests_pending"], m["compile_attn_kv_cache_usage_perc"])
            if settled == (0, 0, 0, 0) or time.monotonic() > end:
                break
            time.sleep(0.05)
        assert settled == (0, 0, 0, 0)
        aborted = m.get("compile_attn_request_success_total{abort}", 0) - first.get(
            "compile_attn_request_success_total{abort}", 0)
        assert aborted == 4
        wait_idle(engine)


def test_engine_gone_gives_503_and_an_error_event(engine: AsyncLLM) -> None:
    """The front end (its own process) loses its engine mid-request, as when the engine's process dies: a whole
    request gets a 503 with OpenAI's body, a stream an error event then [DONE], /health 503; the engine's side
    aborts what the lost front end had (KV fresh)."""

    async def main(url: str) -> tuple:
        async with httpx.AsyncClient(timeout=60) as client:
            stream = asyncio.ensure_future(_read_stream(client, url, _body(_prompt(1, 8), 4000)))
            whole = asyncio.ensure_future(client.post(url + "/v1/completions",
                                                      json=_body(_prompt(2, 8), 4000, stream=False)))
            end = time.monotonic() + 30
            while engine.num_pending < 2:
                assert time.monotonic() < end
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            # the engine's end of the channel closes (its lifeline too): what the front end sees when that process dies
            engine.call(lambda _llm: [port.release() for port in engine._ports]).result(10)
            health = None
            while health != 503 and time.monotonic() < end:
                health = (await client.get(url + "/health")).status_code
            return await stream, await whole, health

    with serving(engine, "toy", "process") as front:
        stream, whole, health = asyncio.run(asyncio.wait_for(main(front.url), 60))
    assert stream["status"] == 200 and stream["done"] and stream["finish"] is None
    assert stream["error"]["error"]["type"] == "server_error"
    assert whole.status_code == 503 and whole.json()["error"]["type"] == "server_error"
    assert health == 503
    wait_idle(engine)
