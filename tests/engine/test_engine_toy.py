"""Engine on the CPU with ToyDecoder: greedy tokens equal an independent no-cache recompute, under
continuous batching, chunked prefill, staggered arrivals, and preemption in a tiny KV pool."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from compile_attn import ForwardMode
from compile_attn.compiler import compile_counters
from compile_attn.engine import LLM, RequestTooLargeError, SamplingParams
from compile_attn.models import ToyDecoder, ToyDecoderConfig
from tests.greedy_reference import greedy_by_recompute

CFG = ToyDecoderConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64, sliding_window=11)


@pytest.fixture(scope="module")
def model() -> ToyDecoder:
    torch.manual_seed(0)
    return ToyDecoder(CFG).eval()


PROMPTS = [[(7 * i + j) % CFG.vocab_size for j in range(n)] for i, n in enumerate([3, 17, 9, 30, 1])]


def make_llm(model: ToyDecoder, **kw) -> LLM:
    args = dict(max_batch_size=4, max_num_tokens=24, kv_cache_tokens=256, max_context=64, page_size=4,
                graph_mode="none", compile=False, device="cpu")  # the CPU test, also where CUDA is present
    args.update(kw)
    return LLM(model, **args)


@pytest.mark.parametrize(
    ("graph_mode", "compile", "compiler"),
    [
        ("none", False, None),
        ("full", False, None),
        ("breakable", False, None),
        ("piecewise", True, "eager"),
        ("full_and_piecewise", True, "inductor"),
    ],
)
def test_greedy_equals_recompute_in_every_graph_mode(model: ToyDecoder, graph_mode: str, compile: bool,
                                                     compiler: str | None) -> None:
    options = {"compiler": compiler, "verify": True} if compile else {"verify": True}
    llm = make_llm(model, graph_mode=graph_mode, compile=compile, compile_options=options)
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=8))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_by_recompute(model, prompt, 8)
    stats = llm.step_runner.runner.stats
    if graph_mode != "none":
        assert stats.captures, f"{graph_mode}: no graph was captured"
        assert set(stats.capture_seconds_by_mode) == set(stats.captures)  # the start-time split covers each mode
        assert 0 < stats.first_capture_seconds <= sum(stats.capture_seconds_by_mode.values()) <= stats.capture_seconds
        assert sum(n for mode, n in stats.runs.items() if mode != "none") > 0, f"{graph_mode}: no step replayed"
    if compile:
        from compile_attn.compiler import compile_counters

        assert compile_counters.split_op_pieces >= CFG.num_layers


@pytest.mark.parametrize("graph_mode", ["piecewise", "full_and_piecewise"])
def test_no_dynamo_compile_after_capture(model: ToyDecoder, graph_mode: str) -> None:
    """Capture and steps call the compiled model in the same grad mode (inference), so serving compiles nothing:
    no new Dynamo graph, and with it no second set of piecewise graphs captured on first use of each bucket."""
    torch._dynamo.reset()  # other tests' compiled entries for the same model code would sit in Dynamo's cache
    llm = make_llm(model, graph_mode=graph_mode, compile=True, compile_options={"compiler": "eager"})
    before = compile_counters.snapshot()
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=6))
    delta = compile_counters.delta(before)
    assert delta.get("graphs_seen", 0) == 0 and delta.get("recompiles", 0) == 0, delta
    assert not llm.step_runner.runner.model_calls.guards_needed
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_by_recompute(model, prompt, 6)


def test_greedy_equals_recompute_with_chunked_prefill(model: ToyDecoder) -> None:
    llm = make_llm(model)
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=8))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_by_recompute(model, prompt, 8)
        assert out.finish_reason == "length" and out.prompt_token_ids == prompt
    assert llm.kv_cache.available_tokens == llm.kv_cache.allocator.num_pages * 4  # everything freed


def test_staggered_arrivals_give_the_same_tokens(model: ToyDecoder) -> None:
    llm = make_llm(model)
    params = SamplingParams(max_new_tokens=6)
    reqs = [llm.add_request(PROMPTS[0], params)]
    for p in PROMPTS[1:]:
        llm.step(), llm.step()
        reqs.append(llm.add_request(p, params))  # arrives while the others decode
    while llm.has_work():
        llm.step()
    assert llm.steps_by_mode[ForwardMode.MIXED] > 0, "no step mixed prefill with decode"
    for p, r in zip(PROMPTS, reqs):
        assert r.output_ids == greedy_by_recompute(model, p, 6)


def test_tiny_kv_pool_preempts_and_still_matches(model: ToyDecoder) -> None:
    llm = make_llm(model, kv_cache_tokens=48, max_context=48)
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=10))
    assert llm.scheduler.num_preemptions > 0, "the pool was meant to be too small to hold every request"
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_by_recompute(model, prompt, 10)
    assert llm.kv_cache.available_tokens == 48 and llm.kv_cache.req_to_token_pool.available == 4


def test_request_that_can_never_fit_is_rejected_before_anything_runs(model: ToyDecoder) -> None:
    llm = make_llm(model, kv_cache_tokens=32, max_context=64)
    with pytest.raises(RequestTooLargeError, match="needs up to 40 tokens .* KV cache holds 32 tokens"):
        llm.generate([[1, 2], list(range(30))], SamplingParams(max_new_tokens=10))
    assert not llm.has_work()  # the call was refused whole: nothing queued, nothing allocated
    assert llm.kv_cache.available_tokens == 32


def test_stop_tokens_and_eos(model: ToyDecoder) -> None:
    llm = make_llm(model)
    free_run = greedy_by_recompute(model, PROMPTS[1], 6)
    stop = free_run[3]
    out = llm.generate([PROMPTS[1]], SamplingParams(max_new_tokens=6, stop_token_ids=(stop,)))[0]
    assert out.token_ids == free_run[: free_run.index(stop) + 1] and out.finish_reason == "stop"
    llm.eos_token_ids = {stop}
    assert llm.generate([PROMPTS[1]], SamplingParams(max_new_tokens=6))[0].finish_reason == "stop"
    out = llm.generate([PROMPTS[1]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert out.token_ids == free_run and out.finish_reason == "length"


def test_seeded_sampling_is_independent_of_batch_composition(model: ToyDecoder) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=1234)
    alone = make_llm(model).generate([PROMPTS[2]], params)[0].token_ids
    crowd = make_llm(model).generate(PROMPTS, [SamplingParams(max_new_tokens=5, temperature=1.0)] * 2 + [params]
                                     + [SamplingParams(max_new_tokens=5)] * 2)
    assert crowd[2].token_ids == alone
    # greedy requests in a sampling batch (the sampler's temperature-0 rows) and alone (the engine's argmax path)
    assert crowd[3].token_ids == greedy_by_recompute(model, PROMPTS[3], 5)
    assert make_llm(model).generate([PROMPTS[3]], SamplingParams(max_new_tokens=5))[0].token_ids == crowd[3].token_ids
    greedy = greedy_by_recompute(model, PROMPTS[2], 8)
    assert alone != greedy  # sampling actually sampled (8 tokens from a near-uniform toy model)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted Triton on the CPU (a GPU compiles it and "
                    "refuses the CPU cache); tests/engine/test_engine_gpu.py runs the engine on the GPU")
@pytest.mark.parametrize("graph_mode", ["full", "none"])
def test_hybrid_backend_greedy_equals_recompute(graph_mode: str) -> None:
    """Triton (interpreted on the CPU) prefills, torch_native decodes, in full decode graphs + breakable
    extend graphs: the same tokens as the no-cache recompute, requests arriving while others decode."""
    pytest.importorskip("triton")
    torch.manual_seed(1)
    model = ToyDecoder(ToyDecoderConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                        head_dim=64, intermediate_size=64, sliding_window=11)).eval()
    llm = make_llm(model, attn_backend="triton+torch_native", graph_mode=graph_mode, compile_options={"verify": True})
    assert llm.backend.name == "triton+torch_native"
    params = SamplingParams(max_new_tokens=5)
    reqs = [llm.add_request(PROMPTS[0], params)]
    for p in PROMPTS[1:3]:
        llm.step()
        reqs.append(llm.add_request(p, params))
    while llm.has_work():
        llm.step()
    for p, r in zip(PROMPTS, reqs):
        assert r.output_ids == greedy_by_recompute(model, p, 5)
    if graph_mode == "full":
        assert llm.step_runner.runner.stats.runs["full"] > 0, "no decode step replayed a full graph"


@pytest.mark.parametrize("prompt,bad", [([1, 2.5, 3], "2.5 (float)"), ([4, "5"], "'5' (str)"), ([2**70], str(2**70))])
def test_prompt_ids_that_are_not_int64_are_refused_by_name(model: ToyDecoder, prompt: list, bad: str) -> None:
    llm = make_llm(model, graph_mode="none", compile=False)
    with pytest.raises(ValueError, match=f"prompt token ids must be integers.*got {re.escape(bad)}"):
        llm.generate([prompt], SamplingParams(max_new_tokens=1))
    assert not llm.has_work()  # nothing was queued
    ids = [torch.tensor(3), 4, np.int64(1)]  # an integer with __index__ is taken as its integer (a bool is not)
    assert llm.generate([ids], SamplingParams(max_new_tokens=1, temperature=0))[0].prompt_token_ids == [3, 4, 1]
