"""Speculative decoding (n-gram chains) in the engine on the CPU: greedy outputs identical with speculation on and
off in every graph mode and for the six HF families, seeded sampled outputs identical, sampled outputs following the
target distribution (chi-square against the model's exact probabilities), the KV pool exact after accept / reject /
preempt / abort, logprobs, stop strings and length limits token by token, and no compile after warm-up."""

from __future__ import annotations

import pytest
import torch

from compile_attn import ForwardMode
from compile_attn.compiler import compile_counters
from compile_attn.engine import LLM, SamplingParams
from compile_attn.models import ToyDecoder, ToyDecoderConfig
from tests.engine.execution.speculative.target_distribution import (
    assert_tokens_2_and_3_follow, joint_of_tokens_2_and_3, peaked_model)
from tests.greedy_reference import greedy_by_recompute

CFG = ToyDecoderConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64, sliding_window=11)
# Prompts that repeat themselves, so prompt lookup finds drafts from the first decode step on.
PROMPTS = [[(7 * i + j) % 11 for j in range(n)] for i, n in enumerate([3, 17, 9, 30, 1])]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def model() -> ToyDecoder:
    torch.manual_seed(0)
    return ToyDecoder(CFG).eval()


def make_llm(model: torch.nn.Module, **kw) -> LLM:
    args = dict(max_batch_size=4, max_num_tokens=24, kv_cache_tokens=256, max_context=64, page_size=4,
                graph_mode="none", compile=False, device="cpu")
    args.update(kw)
    return LLM(model, **args)


def check_pool(llm: LLM) -> None:
    """Between steps every running request's KV row holds exactly its computed tokens, in whole pages."""
    kv = llm.kv_cache
    for r in llm.scheduler.running:
        assert kv.row_len(r.row) == r.num_cached <= len(r.token_ids) - 1, (r.request_id, kv.row_len(r.row))
        assert len(kv.row_pages(r.row)) == -(-r.num_cached // kv.page_size)
        assert not r.draft_ids


@pytest.mark.parametrize(("graph_mode", "compile"), [("none", False), ("full", False), ("breakable", False),
                                                      ("piecewise", True), ("full_and_piecewise", True)])
def test_greedy_outputs_are_identical_with_speculation_in_every_graph_mode(model, graph_mode, compile) -> None:  # noqa: ANN001
    options = {"compiler": "eager", "verify": True} if compile else {"verify": True}
    llm = make_llm(model, graph_mode=graph_mode, compile=compile, compile_options=options, speculative_config=NGRAM)
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=12))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_by_recompute(model, prompt, 12)
    stats = llm.speculator.stats
    assert stats.accepted_tokens > 0 and 0 < llm.steps_by_mode[ForwardMode.TARGET_VERIFY] <= stats.verify_steps
    assert llm.num_steps < sum(len(o.token_ids) for o in outs) / len(PROMPTS) + 12  # fewer steps than tokens


def test_fewer_steps_and_the_counts_add_up(model) -> None:  # noqa: ANN001
    plain, spec = make_llm(model), make_llm(model, speculative_config=NGRAM)
    a = plain.generate(PROMPTS, SamplingParams(max_new_tokens=30))
    b = spec.generate(PROMPTS, SamplingParams(max_new_tokens=30))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    s = spec.speculator.stats
    assert spec.num_steps < plain.num_steps
    assert 0 < s.accepted_tokens <= s.draft_tokens and s.verified >= s.verify_steps
    assert s.mean_accepted_length == pytest.approx(1 + s.accepted_tokens / s.verified)
    assert spec.kv_cache.allocator.available + spec.kv_cache.prefix_cache.evictable_pages == \
        spec.kv_cache.allocator.num_pages  # everything back, cached pages evictable


def test_seeded_samples_are_identical_with_speculation(model) -> None:  # noqa: ANN001
    params = [SamplingParams(max_new_tokens=20, temperature=t, top_k=k, seed=s)
              for t, k, s in [(0.2, 0, 1), (0.5, 5, 2), (0.1, 0, 3), (1.5, 20, 4), (0.3, 0, 5)]]
    a = make_llm(model).generate(PROMPTS, params)
    spec = make_llm(model, speculative_config=NGRAM)
    b = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert spec.speculator.stats.accepted_tokens > 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"])
def test_hf_families_greedy_identical_with_speculation(family: str) -> None:
    from tests.hf.hf_tiny_models import build_pair

    ours, _ = build_pair(family, attn="eager")
    prompts = [[(3 * i + j) % 7 + 1 for j in range(n)] for i, n in enumerate([5, 12, 9])]
    plain = make_llm(ours, max_context=48).generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    spec = make_llm(ours, max_context=48, speculative_config=NGRAM, overlap=False)  # looks for drafts every step
    outs = spec.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain], family
    assert spec.speculator.stats.verify_steps > 0


def test_pool_is_exact_after_accept_reject_preempt_and_abort(model) -> None:  # noqa: ANN001
    # A pool of 12 pages of 4 tokens for 4 requests of up to 40 tokens: preemptions happen.
    llm = make_llm(model, kv_cache_tokens=48, enable_prefix_cache=False, speculative_config=NGRAM)
    reqs = [llm.add_request(p, SamplingParams(max_new_tokens=16)) for p in PROMPTS[:4]]
    steps = 0
    while llm.has_work():
        llm.step()
        check_pool(llm)
        steps += 1
        if steps == 6:
            llm.abort_request(reqs[1])
            check_pool(llm)
    assert llm.scheduler.num_preemptions > 0 and llm.speculator.stats.accepted_tokens > 0
    assert llm.kv_cache.allocator.available == llm.kv_cache.allocator.num_pages
    for i in (0, 2, 3):
        assert reqs[i].output_ids == greedy_by_recompute(model, PROMPTS[i], 16)
    assert reqs[1].finish_reason == "abort"


def test_prefix_cache_holds_only_verified_tokens(model) -> None:  # noqa: ANN001
    """Requests that finish insert their KV into the prefix cache; a second round of the same prompts extended by
    the first round's outputs reuses it and still decodes the greedy tokens (a draft's KV in the cache would not)."""
    llm = make_llm(model, speculative_config=NGRAM)
    first = llm.generate(PROMPTS, SamplingParams(max_new_tokens=10))
    longer = [p + o.token_ids for p, o in zip(PROMPTS, first)]
    hits = llm.kv_cache.prefix_cache.num_hit_tokens
    second = llm.generate(longer, SamplingParams(max_new_tokens=10))
    assert llm.kv_cache.prefix_cache.num_hit_tokens > hits
    for prompt, out in zip(longer, second):
        assert out.token_ids == greedy_by_recompute(model, prompt, 10)


def test_stop_strings_tokens_and_length_limits_hold_token_by_token(model) -> None:  # noqa: ANN001
    ref = greedy_by_recompute(model, PROMPTS[3], 30)
    spec = make_llm(model, speculative_config=NGRAM)
    for n in (1, 2, 5, 13):
        (out,) = spec.generate([PROMPTS[3]], SamplingParams(max_new_tokens=n))
        assert out.token_ids == ref[:n] and out.finish_reason == "length"
    stop_at = ref.index(ref[8]) + 1  # the first occurrence of ref[8] ends the request
    (out,) = spec.generate([PROMPTS[3]], SamplingParams(max_new_tokens=30, stop_token_ids=[ref[8]]))
    assert out.token_ids == ref[:stop_at] and out.finish_reason == "stop" and out.outputs[0].stop_reason == ref[8]
    spec.eos_token_ids = {ref[5]}
    (out,) = spec.generate([PROMPTS[3]], SamplingParams(max_new_tokens=30))
    assert out.token_ids == ref[: ref.index(ref[5]) + 1] and out.finish_reason == "stop"


def test_logprobs_of_accepted_tokens_match_plain_decoding(model) -> None:  # noqa: ANN001
    params = SamplingParams(max_new_tokens=16, logprobs=2)
    a = make_llm(model).generate(PROMPTS, params)
    spec = make_llm(model, speculative_config=NGRAM)
    b = spec.generate(PROMPTS, params)
    assert spec.speculator.stats.accepted_tokens > 0
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        lx, ly = x.outputs[0].logprobs, y.outputs[0].logprobs
        assert len(lx) == len(ly) == len(x.token_ids)
        for ex, ey in zip(lx, ly):
            assert ex.keys() == ey.keys()
            for tok in ex:
                assert ey[tok].logprob == pytest.approx(ex[tok].logprob, abs=1e-5)


def test_penalised_requests_get_drafts(model) -> None:  # noqa: ANN001
    """Penalties hold row by row (more in test_speculative_penalties.py)."""
    params = SamplingParams(max_new_tokens=12, repetition_penalty=1.3)
    a = make_llm(model).generate(PROMPTS, params)
    spec = make_llm(model, speculative_config=NGRAM)
    b = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert spec.speculator.stats.draft_tokens > 0


def test_nothing_compiles_on_speculative_traffic_after_warm_up(model) -> None:  # noqa: ANN001
    torch._dynamo.reset()
    llm = make_llm(model, graph_mode="full_and_piecewise", compile=True, compile_options={"compiler": "eager"},
                   speculative_config=NGRAM)
    before = compile_counters.snapshot()
    llm.generate(PROMPTS, SamplingParams(max_new_tokens=10))
    delta = compile_counters.delta(before)
    assert delta.get("graphs_seen", 0) == 0 and delta.get("recompiles", 0) == 0, delta
    assert llm.speculator.stats.verify_steps > 0


# ---------------------------------------------------------------------------- the output distribution
def test_sampled_outputs_follow_the_target_distribution() -> None:
    """The joint distribution of the 2nd and 3rd output tokens (produced by verify steps, the 3rd often an accepted
    draft) over many unseeded samples against the exact one from the model, by a chi-square test."""
    small = peaked_model()
    # The model's own greedy path: prompt lookup proposes the loop it falls into, which sampling often follows.
    prompt = [0] + greedy_by_recompute(small, [0], 11)
    joint = joint_of_tokens_2_and_3(small, prompt)
    n = 3000
    llm = make_llm(small, max_batch_size=256, max_num_tokens=2048, kv_cache_tokens=256 * 20, max_context=20,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                       "prompt_lookup_max": 2})
    outs = llm.generate([prompt] * n, SamplingParams(max_new_tokens=4, temperature=1.0), use_tqdm=False)
    stats = llm.speculator.stats
    assert stats.accepted_tokens > n // 10, stats  # many third tokens came from accepted drafts
    assert_tokens_2_and_3_follow(outs, joint)


def test_plain_steps_overlap_and_drafts_are_looked_for_again(model) -> None:  # noqa: ANN001
    """With nothing to propose the engine overlaps steps (a placeholder in flight) and reads every token first after
    1, 2, 4, .. 8 plain steps; a step with drafts runs serially. Tokens are the same either way."""
    from compile_attn.engine.execution.speculative.speculator import PROBE_EVERY

    llm = make_llm(model, speculative_config=NGRAM)
    unique = [[(5 * i + 3 * j) % 97 for j in range(12)] for i in range(3)]  # no repeats: few proposals early on
    seen_in_flight = 0
    reqs = [llm.add_request(p, SamplingParams(max_new_tokens=40)) for p in unique]
    while llm.has_work():
        llm.step()
        seen_in_flight += bool(llm._in_flight)
    assert seen_in_flight > 0  # some plain steps overlapped the next
    for p, r in zip(unique, reqs):
        assert r.output_ids == greedy_by_recompute(model, p, 40)
    s = llm.speculator
    assert [s.probe_due() for _ in range(2 * PROBE_EVERY)].count(True) <= 4  # backed off to one in PROBE_EVERY
