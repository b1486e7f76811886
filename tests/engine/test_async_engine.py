"""AsyncLLM on a toy model: per-step deltas add up to what a separate LLM's generate returns; a consumer that stops
early aborts its request and frees its KV; max_pending is enforced with EngineOverloadedError; a bad request is
refused at submit; shutdown ends unfinished streams with "abort" and leaves the KV pool fresh."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from compile_attn.engine import LLM, InvalidRequestError, SamplingParams
from compile_attn.engine.async_engine import AsyncLLM, EngineOverloadedError, EngineStoppedError
from compile_attn.models import ToyDecoder, ToyDecoderConfig

CFG = ToyDecoderConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64)
ENGINE = dict(max_batch_size=4, max_num_tokens=64, kv_cache_tokens=2048, max_context=512, page_size=4,
              graph_mode="none", compile=False, device="cpu")
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]


def toy_llm() -> LLM:
    torch.manual_seed(0)
    return LLM(ToyDecoder(CFG).eval(), **ENGINE)


@pytest.fixture
def engine() -> AsyncLLM:
    eng = AsyncLLM(toy_llm(), max_pending=2)
    eng.fresh_kv_tokens = eng.llm.kv_cache.available_tokens
    yield eng
    eng.shutdown()


def wait_idle(eng: AsyncLLM) -> None:
    end = time.monotonic() + 10
    while eng.num_pending or eng.llm.kv_cache.available_tokens != eng.fresh_kv_tokens:
        assert time.monotonic() < end, f"{eng.num_pending} pending, {eng.llm.kv_cache.available_tokens} KV free"
        time.sleep(0.01)


def run(coro):  # every test bounded in time
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_deltas_add_up_to_generate(engine: AsyncLLM) -> None:
    params = [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=7, temperature=1.0, seed=3,
                                                                               ignore_eos=True)]
    ref = toy_llm()

    async def collect(prompt, p):
        return [d async for d in engine.generate(prompt, p)]

    async def both(p):
        return await asyncio.gather(*(collect(pr, p) for pr in PROMPTS[:2]))

    for p in params:
        results = run(both(p))
        want = ref.generate(PROMPTS[:2], p)
        for deltas, out in zip(results, want):
            assert [t for d in deltas for t in d.token_ids] == out.token_ids
            assert len(deltas) >= 2 and [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
            assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == len(out.token_ids)
    wait_idle(engine)


def test_consumer_leaving_early_aborts(engine: AsyncLLM) -> None:
    async def main():
        gen = engine.generate(PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True))
        async for d in gen:
            break
        await gen.aclose()

    steps = engine.llm.num_steps
    run(main())
    wait_idle(engine)
    assert engine.num_aborted == 1 and engine.llm.num_steps - steps < 400


def test_max_pending_and_bad_requests(engine: AsyncLLM) -> None:
    async def main():
        long = SamplingParams(max_tokens=300, ignore_eos=True)
        a, b = await engine.submit(PROMPTS[0], long), await engine.submit(PROMPTS[1], long)
        with pytest.raises(EngineOverloadedError):
            await engine.submit(PROMPTS[2], long)
        a.abort()
        async for _ in b:
            pass
        wait_idle(engine)
        with pytest.raises(InvalidRequestError):
            await engine.submit([5, 1000], long)  # a token outside the vocabulary
        with pytest.raises(InvalidRequestError):
            await engine.submit(PROMPTS[0], SamplingParams(max_tokens=600))  # past max_context
        assert engine.num_pending == 0
        return [d async for d in engine.generate(PROMPTS[2], SamplingParams(max_tokens=3))]

    assert sum(len(d.token_ids) for d in run(main())) == 3
    wait_idle(engine)


def test_shutdown_ends_streams_with_abort() -> None:
    eng = AsyncLLM(toy_llm(), max_pending=4)
    fresh = eng.llm.kv_cache.available_tokens

    async def main():
        stream = await eng.submit(PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True))
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        rest = [d async for d in stream]
        with pytest.raises(EngineStoppedError):
            await eng.submit(PROMPTS[0], SamplingParams())
        return rest

    rest = run(main())
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert eng.llm.kv_cache.available_tokens == fresh and not eng.llm.has_work()
