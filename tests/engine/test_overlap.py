"""Overlap scheduling on the CPU: with one step in flight (``LLM(overlap=True)``, the default) every request gets
exactly the tokens and finish reason it gets with the serial loop (``overlap=False``), for the six HF families in
every graph mode, when requests stop on EOS, on stop tokens and on max tokens in the same step, under preemption in
a small KV cache, and with seeded sampling mixed with greedy rows. The serial run is checked against an independent
reference first (its tokens are HF ``generate``'s, cut at the first stop token); the KV pool is empty after every
run and no token computed after a request stopped reaches its output. A stop check that raises while a step's
tokens are read finishes its request alone.
"""

from __future__ import annotations

import pytest

from compile_attn.engine import LLM, SamplingParams
from tests.hf.hf_tiny_models import FAMILIES, build_pair, hf_greedy

PROMPTS = [[(5 * i + 3 * j + 1) % 96 for j in range(n)] for i, n in enumerate([3, 12, 7, 20, 5, 9])]
N_NEW = 10
GRAPH_MODES = [("none", False), ("full", False), ("breakable", False), ("piecewise", True),
               ("full_and_piecewise", True)]


def cut_at(tokens: list[int], stops: set[int]) -> list[int]:
    """``tokens`` up to and including the first one in ``stops``."""
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


def stopping_params(refs: list[list[int]]) -> tuple[list[SamplingParams], set[int], list[list[int]]]:
    """Per-prompt parameters that stop requests in every way, the EOS set to use, and the expected tokens.

    Prompt 0 stops on a stop token (its 4th token), prompt 1 on EOS (its 3rd token, EOS only for requests that do
    not ignore it), prompts 2 and 3 on max_tokens=4 (the same step), prompt 4 on max_tokens=1 (its first token),
    prompt 5 runs to N_NEW ignoring EOS."""
    eos = {refs[1][2]}
    params = [
        SamplingParams(max_tokens=N_NEW, stop_token_ids=[refs[0][3]], ignore_eos=True),
        SamplingParams(max_tokens=N_NEW),
        SamplingParams(max_tokens=4, ignore_eos=True),
        SamplingParams(max_tokens=4, ignore_eos=True),
        SamplingParams(max_tokens=1, ignore_eos=True),
        SamplingParams(max_tokens=N_NEW, ignore_eos=True),
    ]
    expected = [cut_at(refs[0], {refs[0][3]}), cut_at(refs[1], eos), refs[2][:4], refs[3][:4], refs[4][:1], refs[5]]
    return params, eos, expected


def run(llm: LLM, params: list[SamplingParams], *, overlap: bool) -> list[tuple[list[int], str]]:
    llm.overlap = overlap  # the loop policy only: the same compiled model and graphs serve both runs
    outs = llm.generate(PROMPTS, params)
    assert not llm.has_work()
    assert llm.kv_cache.available_tokens == llm.kv_cache.allocator.num_pages * llm.kv_cache.page_size
    assert llm.kv_cache.req_to_token_pool.available == llm.scheduler.max_batch_size
    return [(o.token_ids, o.finish_reason) for o in outs]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest):  # noqa: ANN201
    ours, stock = build_pair(request.param, attn="eager")
    return request.param, ours, [hf_greedy(stock, p, N_NEW) for p in PROMPTS]


@pytest.mark.parametrize(("graph_mode", "compile"), GRAPH_MODES)
def test_overlap_matches_serial_loop(family, graph_mode: str, compile: bool) -> None:  # noqa: ANN001
    name, model, refs = family
    llm = LLM(model, graph_mode=graph_mode, compile=compile, compile_options={"compiler": "eager"},
              max_batch_size=4, max_num_tokens=32, max_context=64, page_size=4, device="cpu")
    params, eos, expected = stopping_params(refs)
    llm.eos_token_ids = eos
    serial = run(llm, params, overlap=False)
    assert [t for t, _ in serial] == expected, f"{name} {graph_mode}: the serial loop is off the reference"
    assert [r for _, r in serial] == ["stop", "stop", "length", "length", "length", "length"]
    steps = llm.num_steps
    overlapped = run(llm, params, overlap=True)
    assert overlapped == serial, f"{name} {graph_mode}"
    assert llm.num_steps - steps >= steps, "the overlapped run computes at least the serial run's steps"


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_in_a_small_cache(overlap: bool) -> None:
    model, stock = build_pair("llama", attn="eager")
    refs = [hf_greedy(stock, p, N_NEW) for p in PROMPTS]
    llm = LLM(model, graph_mode="full", compile=False, max_batch_size=4, max_num_tokens=16, kv_cache_tokens=48,
              max_context=48, page_size=4, device="cpu", overlap=overlap)
    outs = run(llm, [SamplingParams(max_tokens=N_NEW, ignore_eos=True)] * len(PROMPTS), overlap=overlap)
    assert llm.scheduler.num_preemptions > 0, "the cache was meant to be too small for every request at once"
    assert [t for t, _ in outs] == refs


def test_seeded_sampling_mixed_with_greedy_rows() -> None:
    model, stock = build_pair("qwen2", attn="eager")
    llm = LLM(model, graph_mode="full_and_piecewise", compile=True, compile_options={"compiler": "eager"},
              max_batch_size=4, max_num_tokens=32, max_context=64, page_size=4, device="cpu")
    params = [SamplingParams(max_tokens=N_NEW, temperature=0.9, seed=11 + i, top_k=(0, 5)[i % 2],
                             top_p=(1.0, 0.8)[i % 3 == 0], ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=N_NEW - i, ignore_eos=True) for i in range(len(PROMPTS))]
    serial = run(llm, params, overlap=False)
    greedy = [i for i in range(len(PROMPTS)) if i % 2 == 0]
    assert [serial[i][0] for i in greedy] == [hf_greedy(stock, PROMPTS[i], N_NEW - i) for i in greedy]
    assert run(llm, params, overlap=True) == serial
    assert run(llm, params, overlap=True) == serial  # and again: seeds, not the batch, decide the draws


def test_step_api_reports_each_request_once_and_step_later() -> None:
    """``LLM.step`` with overlap: each request is reported finished exactly once, one call after the step that
    sampled its last token; its tokens never include the token computed for it after it stopped."""
    model, stock = build_pair("llama", attn="eager")
    refs = [hf_greedy(stock, p, N_NEW) for p in PROMPTS[:3]]
    llm = LLM(model, graph_mode="none", compile=False, max_batch_size=4, max_num_tokens=32, max_context=64,
              page_size=4, device="cpu")
    reqs = [llm.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(PROMPTS, (2, 5, 9))]
    reported: list[int] = []
    calls = 0
    while llm.has_work():
        calls += 1
        reported += [r.request_id for r in llm.step()]
        for r in reqs:  # a running request's output holds only tokens read back from the device
            assert r.output_ids == refs[r.request_id][: len(r.output_ids)]
    assert sorted(reported) == [r.request_id for r in reqs]
    assert [r.output_ids for r in reqs] == [ref[:n] for ref, n in zip(refs, (2, 5, 9))]
    assert calls == 9 + 1  # one prefill step, eight decode steps, one call to read the last step's tokens


class _StopCheckFailsAt:
    """A stop-string matcher whose ``n``-th update raises (a detokeniser failing on one request's text)."""

    def __init__(self, n: int) -> None:
        self.calls, self.n = 0, n

    def update(self, token_ids: list[int], prompt_len: int) -> None:
        self.calls += 1
        if self.calls == self.n:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failing_stop_check_finishes_only_its_request(overlap: bool) -> None:
    """A stop check that raises while a step's tokens are read finishes that request alone with reason "error",
    keeping the tokens it had; the step's other requests get all their tokens (HF's), and no KV leaks."""
    model, stock = build_pair("llama", attn="eager")
    refs = [hf_greedy(stock, p, N_NEW) for p in PROMPTS[:3]]
    llm = LLM(model, graph_mode="none", compile=False, max_batch_size=4, max_num_tokens=32, max_context=64,
              page_size=4, device="cpu", overlap=overlap)
    reqs = [llm.add_request(p, SamplingParams(max_tokens=N_NEW, ignore_eos=True)) for p in PROMPTS[:3]]
    reqs[1].stop_matcher = _StopCheckFailsAt(3)
    while llm.has_work():
        llm.step()
    assert [r.finish_reason for r in reqs] == ["length", "error", "length"]
    assert reqs[1].output_ids == refs[1][:3]
    assert reqs[0].output_ids == refs[0] and reqs[2].output_ids == refs[2]
    assert llm.kv_cache.available_tokens == llm.kv_cache.allocator.num_pages * llm.kv_cache.page_size
    assert llm.kv_cache.req_to_token_pool.available == llm.scheduler.max_batch_size
