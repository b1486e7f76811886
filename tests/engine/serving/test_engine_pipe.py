"""An AsyncLLM behind a pipe (PipeBridge on the engine's side, EngineClient on the other; here both ends in one
process, the client on its own event loop): the Deltas add up to a separate LLM's generate; a bad request raises
the LLM's error at submit; past max_pending the engine refuses with EngineOverloadedError; a stream closed early
aborts its request; the client's end closing aborts all of its requests (KV fresh, nothing pending); the engine
shutting down fails the client's streams and later submits with EngineStoppedError."""

from __future__ import annotations

import asyncio
import time

import pytest

from compile_attn.engine import InvalidRequestError, SamplingParams
from compile_attn.engine.serving.async_engine import AsyncLLM
from compile_attn.engine.serving.streams import EngineOverloadedError, EngineStoppedError
from compile_attn.engine.serving.engine_pipe import EngineClient, PipeBridge
from tests.engine.serving.test_async_engine import PROMPTS, run, toy_llm, wait_idle


@pytest.fixture
def piped():
    eng = AsyncLLM(toy_llm(), max_pending=2)
    eng.fresh_kv_tokens = eng.llm.kv_cache.available_tokens
    bridge = PipeBridge(eng)
    client = EngineClient(bridge.address, tokenizer=None, max_context=eng.max_context)
    yield eng, bridge, client
    eng.shutdown()
    client.close()


def test_deltas_add_up_to_generate(piped) -> None:
    eng, _, client = piped
    ref = toy_llm()

    async def collect(prompt, p):
        stream = await client.submit(prompt, p)
        return [d async for d in stream]

    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=1.0, seed=3, ignore_eos=True)]

    async def main():  # one event loop: the client belongs to the loop of its first submit
        return [await asyncio.gather(*(collect(pr, p) for pr in PROMPTS[:2])) for p in params]

    for p, results in zip(params, run(main())):
        for prompt, deltas, out in zip(PROMPTS, results, ref.generate(PROMPTS[:2], p)):
            assert [t for d in deltas for t in d.token_ids] == out.token_ids
            assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
            assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == len(out.token_ids)
            assert deltas[-1].num_prompt_tokens == len(prompt)
    assert client.num_pending == 0
    wait_idle(eng)
    assert client.gauges()["kv_capacity_tokens"] == eng.gauges()["kv_capacity_tokens"] > 0


def test_bad_request_and_overload_are_refused(piped) -> None:
    eng, _, client = piped

    async def main():
        with pytest.raises(InvalidRequestError, match="max_tokens|max_new_tokens"):
            await client.submit(PROMPTS[0], SamplingParams(max_tokens=10_000))
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        held = [await client.submit(PROMPTS[k], long) for k in range(2)]
        with pytest.raises(EngineOverloadedError, match="max_pending"):
            await client.submit(PROMPTS[2], long)
        for s in held:
            await s.aclose()

    run(main())
    wait_idle(eng)
    assert eng.num_aborted == 2 and client.num_pending == 0


def test_client_end_closing_aborts_its_requests(piped) -> None:
    eng, _, client = piped

    async def main():
        stream = await client.submit(PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.__anext__()  # generating
        client.close()  # its lifeline and socket close, as when its process dies

    run(main())
    wait_idle(eng)
    assert eng.num_aborted == 1


def test_engine_shutdown_fails_the_clients_streams(piped) -> None:
    eng, _, client = piped

    async def main():
        stream = await client.submit(PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        eng.shutdown()
        with pytest.raises(EngineStoppedError):
            async for _ in stream:  # the aborted last Delta may come first, then the pipe's close
                pass
            await client.submit(PROMPTS[1], SamplingParams(max_tokens=4))
        with pytest.raises(EngineStoppedError):
            await client.submit(PROMPTS[1], SamplingParams(max_tokens=4))

    run(main())
    assert not client.alive


def test_cancelled_while_waiting_for_admission_is_dropped(piped) -> None:
    eng, _, client = piped
    blocked = eng.call(lambda llm: time.sleep(0.5))

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.submit(PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True)), 0.1)

    run(main())
    blocked.result(5)
    end = time.monotonic() + 10  # the loop reads the pipe (the add, then the abort) after the blocking call
    while eng.num_aborted == 0:
        assert time.monotonic() < end, "the request was never aborted"
        time.sleep(0.01)
    wait_idle(eng)
    assert eng.num_aborted == 1 and client.num_pending == 0


def test_delta_fields_round_trip() -> None:
    """What the pipe carries (``Delta.fields()``, built by the engine's loop for a pipe's streams) gives the Delta
    back with the client's text."""
    from compile_attn.engine.serving.streams import Delta

    d = Delta([5, 6], "ab", True, "stop", 3, 9, [{5: -0.1}, {6: -0.2}], "xxab", "yy")
    assert Delta.from_fields(d.fields(), "ab") == d
    assert len(d.fields()) == len(Delta.__dataclass_fields__) - 1  # every field but the text


def test_a_client_that_reads_nothing_never_stalls_the_steps() -> None:
    """A client that sends its requests and then reads nothing: once ``max_unacked`` messages are unacknowledged
    the engine holds each step's tokens (merged per request) and finishes every request regardless; the client then
    reads each request's tokens whole and in order, in far fewer items than tokens."""
    from compile_attn.engine.serving.streams import merge_fields

    eng = AsyncLLM(toy_llm(), max_pending=8)
    eng.fresh_kv_tokens = eng.llm.kv_cache.available_tokens
    bridge = PipeBridge(eng)
    bridge.max_unacked = 1  # anything unacknowledged: later steps wait
    client = bridge.address.connect()  # the raw channel: sends commands, never acknowledges
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    try:
        for key, prompt in enumerate(PROMPTS[:3]):
            client.send(("add", key, prompt, params))
        end = time.monotonic() + 10  # the engine reads the adds when it gets to them: wait for all three
        while eng.stats.snapshot().num_first_tokens < 3 and time.monotonic() < end:
            time.sleep(0.01)
        wait_idle(eng)  # every request finished with nothing read
        assert bridge.num_held > 0
        got: dict[int, tuple] = {}
        items = 0
        end = time.monotonic() + 10
        while len([k for k, f in got.items() if f[1]]) < 3:
            assert time.monotonic() < end, f"not every request finished: {got}"
            for _, out, _ in client.receive():
                for key, item in out:
                    if isinstance(item, tuple):
                        items += 1
                        got[key] = merge_fields(got[key], item) if key in got else item
            time.sleep(0.01)
        ref = toy_llm().generate(PROMPTS[:3], params)
        for key, out in enumerate(ref):
            ids, finished, reason, num_prompt, num_output = got[key][:5]
            assert ids == out.token_ids and finished and reason == "length"
            assert num_output == len(ids) == 48 and num_prompt == len(PROMPTS[key])
        assert items < 3 * 48 / 4
    finally:
        eng.shutdown()
        client.close()


def test_merged_deltas_carry_both_tokens_and_the_later_state() -> None:
    """What a lagging consumer gets for two Deltas in a row (the bridge's merged fields, a stream's merged Deltas),
    written out by hand."""
    from compile_attn.engine.serving.streams import Delta, merge_deltas, merge_fields

    a = Delta([1], "a", False, None, 3, 1, None, None)
    b = Delta([2, 3], "bc", True, "stop", 3, 3, [{2: -0.5}, {3: -0.1}], "xyz", 3)
    expected = Delta([1, 2, 3], "abc", True, "stop", 3, 3, [{2: -0.5}, {3: -0.1}], "xyz", 3)
    assert merge_deltas(a, b) == expected
    assert merge_fields(a.fields(), b.fields()) == expected.fields()
    c = Delta([4], "", False, None, 3, 2, [{4: -1.0}], None)  # logprobs on one side only
    assert merge_deltas(a, c) == Delta([1, 4], "a", False, None, 3, 2, [{4: -1.0}], None)


def test_a_message_far_larger_than_a_pipe_buffer_goes_whole_and_later_requests_are_answered(piped) -> None:
    """A request whose message is megabytes (a prompt of 1,000,000 ids, beyond the context) reaches the engine whole
    and is refused by it with the LLM's error; a request over the client's ``max_message_bytes`` is refused before
    it is sent; the next requests are answered as a separate LLM answers them."""
    from compile_attn.engine.requests.errors import MessageTooLargeError

    eng, _, client = piped
    ref = toy_llm()
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    async def main():
        with pytest.raises(InvalidRequestError, match="context|max_context|tokens"):
            await client.submit([7] * 1_000_000, params)
        client.max_message_bytes = 100_000
        with pytest.raises(MessageTooLargeError, match="max_message_bytes|limit"):
            await client.submit([7] * 200_000, params)
        out = []
        for p in PROMPTS[:2]:
            stream = await client.submit(p, params)
            out.append([t async for d in stream for t in d.token_ids])
        return out

    got = run(main())
    assert got == [o.token_ids for o in ref.generate(PROMPTS[:2], params)]
    wait_idle(eng)
    assert client.num_pending == 0
