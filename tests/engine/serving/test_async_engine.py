"""AsyncLLM on a toy model: per-step deltas add up to what a separate LLM's generate returns; a consumer that stops
early aborts its request and frees its KV; max_pending is enforced with EngineOverloadedError; a bad request is
refused at submit; shutdown ends unfinished streams with "abort" and leaves the KV pool fresh. A step that fails
(a model whose forward raises on chosen calls) is retried: one failure leaves the tokens exactly those of a separate
LLM, failures past max_step_retries fail the active streams with the model's exception and the engine serves the
next request; the step counters count the steps the LLM ran and the requests in each; ``call`` runs on the loop
thread."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from compile_attn.engine import LLM, InvalidRequestError, SamplingParams
from compile_attn.engine.serving.async_engine import AsyncLLM
from compile_attn.engine.serving.streams import EngineOverloadedError, EngineStoppedError
from compile_attn.models import ToyDecoder, ToyDecoderConfig
from compile_attn.engine.serving.loop_stats import LoopStats, StepCounts

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


class FlakyDecoder(ToyDecoder):
    """The toy model, raising on the forward calls numbered in ``fail`` (counted from 1 after ``arm``)."""

    def __init__(self) -> None:
        super().__init__(CFG)
        self.fail, self.calls = set(), 0

    def arm(self, fail: set[int]) -> None:
        self.fail = {self.calls + k for k in fail}

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls in self.fail:
            raise RuntimeError(f"injected fault in forward call {self.calls}")
        return super().hidden_states(input_ids, positions)


def flaky_engine(fail: set[int], **kw) -> AsyncLLM:
    torch.manual_seed(0)  # the same weights as toy_llm()
    model = FlakyDecoder().eval()
    llm = LLM(model, **ENGINE)
    model.arm(fail)  # counted from the first step (the engine's start-up ran the model too)
    return AsyncLLM(llm, **kw)


async def _collect(eng: AsyncLLM, prompt: list[int], params: SamplingParams) -> list[int] | BaseException:
    try:
        return [t async for d in eng.generate(prompt, params) for t in d.token_ids]
    except RuntimeError as exc:
        return exc


def test_a_failed_step_is_retried_and_changes_nothing() -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    eng = flaky_engine({4})
    fresh = eng.llm.kv_cache.available_tokens
    try:
        async def main():
            return await asyncio.gather(*(_collect(eng, p, params) for p in PROMPTS))

        got = run(main())
        want = toy_llm().generate(PROMPTS, params)
        assert got == [o.token_ids for o in want]
        assert eng.num_failed_steps == 1 and eng.num_aborted == 0
        assert max(eng.llm.model.fail) < eng.llm.model.calls  # the fault was hit, and the steps after it ran
        wait_idle_fresh(eng, fresh)
    finally:
        eng.shutdown()


def test_a_step_failing_past_the_retries_fails_the_active_streams_only() -> None:
    eng = flaky_engine({3, 4, 5}, max_step_retries=2)
    fresh = eng.llm.kv_cache.available_tokens
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    try:
        async def main():
            first = await asyncio.gather(*(_collect(eng, p, params) for p in PROMPTS[:2]))
            after = await _collect(eng, PROMPTS[2], params)
            return first, after

        first, after = run(main())
        assert all(isinstance(r, RuntimeError) and "injected fault" in str(r) for r in first)
        assert eng.num_failed_steps == 3 and eng.num_aborted == 2
        assert after == toy_llm().generate([PROMPTS[2]], params)[0].token_ids  # the engine goes on serving
        wait_idle_fresh(eng, fresh)
    finally:
        eng.shutdown()


def test_step_counts_and_call(engine: AsyncLLM) -> None:
    before = engine.stats.snapshot()
    steps = engine.llm.num_steps
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(_collect(engine, p, params) for p in PROMPTS[:2]))

    assert [len(t) for t in run(main())] == [6, 6]
    wait_idle(engine)
    diff = engine.stats.snapshot() - before
    assert diff.steps == engine.llm.num_steps - steps >= 6
    assert sum(diff.by_batch.values()) == diff.steps and max(diff.by_batch) <= 2 and diff.seconds > 0
    before, steps = engine.stats.snapshot(), engine.llm.num_steps
    assert len(run(_collect(engine, PROMPTS[2], params))) == 6
    wait_idle(engine)
    assert (engine.stats.snapshot() - before).by_batch == {1: engine.llm.num_steps - steps}  # the last step too
    assert engine.call(lambda llm: llm.num_steps).result(5) == engine.llm.num_steps
    with pytest.raises(ZeroDivisionError):
        engine.call(lambda llm: 1 / 0).result(5)


def test_step_counts_mean_and_median() -> None:
    c = StepCounts(steps=5, seconds=0.5, by_batch={1: 1, 3: 2, 8: 2}) - StepCounts(steps=1, seconds=0.1,
                                                                                      by_batch={8: 1})
    assert (c.steps, c.by_batch) == (4, {1: 1, 3: 2, 8: 1})
    assert c.mean_batch == pytest.approx((1 + 3 + 3 + 8) / 4) and c.median_batch == 3
    assert c.mean_step_ms == pytest.approx(100.0)
    assert StepCounts().median_batch is None and StepCounts().mean_batch is None


def test_first_token_times_are_counted_per_request(engine: AsyncLLM) -> None:
    stats = LoopStats()
    for x in (0.3, 0.1, 0.2):
        stats.add_first_token(x)
    before = stats.snapshot()
    for x in (0.5, 0.4):
        stats.add_first_token(x)
    diff = stats.snapshot() - before
    assert diff.first_tokens == (0.5, 0.4) and diff.num_first_tokens == 2
    assert diff.summary()["engine_ttft_p50_ms"] == pytest.approx(400.0)  # the lower middle of two

    before, start = engine.stats.snapshot(), time.perf_counter()

    async def one(prompt):
        return [d async for d in engine.generate(prompt, SamplingParams(max_tokens=5, ignore_eos=True))]

    async def both():
        return await asyncio.gather(one(PROMPTS[0]), one(PROMPTS[1]))

    run(both())
    elapsed = time.perf_counter() - start
    diff = engine.stats.snapshot() - before
    assert diff.num_first_tokens == 2 and all(0 < t < elapsed for t in diff.first_tokens)
    wait_idle(engine)


def wait_idle_fresh(eng: AsyncLLM, fresh: int) -> None:
    eng.fresh_kv_tokens = fresh
    wait_idle(eng)


def test_cancelled_while_waiting_for_admission_is_dropped(engine: AsyncLLM) -> None:
    blocked = engine.call(lambda llm: time.sleep(0.5))  # the loop is busy: the next add waits for it

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.submit(PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True)), 0.1)
        while engine.num_pending:  # this event loop stays open (as a server's does) while the loop catches up
            await asyncio.sleep(0.01)

    run(main())
    blocked.result(5)
    wait_idle(engine)
    assert engine.num_aborted == 1
