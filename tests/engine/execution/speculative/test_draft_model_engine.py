"""Speculative decoding with a draft model in the engine on the CPU: greedy outputs identical with and without it in
every graph mode and for the six HF families, a draft equal to the target accepting every draft, seeded samples
identical, sampled outputs following the target distribution when the draft differs from it (chi-square), both KV
pools exact through accept / reject / preempt / abort, no compile after warm-up, and the option's checks."""

from __future__ import annotations

import copy

import pytest
import torch

from compile_attn.compiler import compile_counters
from compile_attn.engine import LLM, SamplingParams
from compile_attn.engine.requests.errors import EngineOptionError
from compile_attn.models import ToyDecoder, ToyDecoderConfig
from tests.engine.execution.speculative.target_distribution import (
    assert_tokens_2_and_3_follow, joint_of_tokens_2_and_3, peaked_model)
from tests.engine.execution.speculative.test_speculative_engine import CFG, PROMPTS, make_llm
from tests.greedy_reference import greedy_by_recompute

DRAFT_CFG = ToyDecoderConfig(vocab_size=97, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                             intermediate_size=32)


def draft_config(draft: object, k: int = 3) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def model() -> ToyDecoder:
    torch.manual_seed(0)
    return ToyDecoder(CFG).eval()


@pytest.fixture(scope="module")
def small_draft() -> ToyDecoder:
    torch.manual_seed(1)
    return ToyDecoder(DRAFT_CFG).eval()


def check_pools(llm: LLM) -> None:
    """Between steps the target's rows hold exactly their computed tokens, and each draft row holds a prefix of its
    request's tokens and at most K - 1 drafts after them, in whole pages."""
    kv = llm.kv_cache
    draft = llm.speculator.draft
    for r in llm.scheduler.running:
        assert kv.row_len(r.row) == r.num_cached <= len(r.token_ids) - 1
        state = draft._rows.get(r.request_id)
        if state is not None:
            held = draft.kv_cache.row_len(state.row)
            assert held == len(state.held)
            assert len(draft.kv_cache.row_pages(state.row)) == -(-held // draft.kv_cache.page_size)
            verified = held - state.unverified
            assert list(state.held[:verified]) == list(r.token_ids[:verified])
            assert state.unverified <= draft.k - 1
    live = {r.request_id for r in llm.scheduler.running}
    assert set(draft._rows) <= live | {r.request_id for s in llm._in_flight for r in s.requests}


@pytest.mark.parametrize(("graph_mode", "compile"), [("none", False), ("full", False), ("breakable", False),
                                                      ("piecewise", True), ("full_and_piecewise", True)])
def test_greedy_outputs_are_identical_with_a_draft_model_in_every_graph_mode(model, small_draft, graph_mode,  # noqa: ANN001
                                                                             compile) -> None:
    options = {"compiler": "eager", "verify": True} if compile else {"verify": True}
    llm = make_llm(model, graph_mode=graph_mode, compile=compile, compile_options=options,
                   speculative_config=draft_config(copy.deepcopy(small_draft)))
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=12))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_by_recompute(model, prompt, 12)
    assert llm.speculator.stats.verify_steps > 0 and llm.speculator.draft.steps > 0


def test_a_draft_equal_to_the_target_has_every_draft_accepted(model) -> None:  # noqa: ANN001
    """The target drafting for itself: every greedy draft is the target's own next token, so a verify step gains
    K + 1 tokens while the request has room (the mechanism's ceiling)."""
    k = 3
    llm = make_llm(model, speculative_config=draft_config(copy.deepcopy(model), k))
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=24))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_by_recompute(model, prompt, 24)
    s = llm.speculator.stats
    assert s.accepted_tokens == s.draft_tokens > 0
    # 24 tokens per request: 1 from its prefill, 23 from verify steps of k + 1 tokens (fewer in the last one).
    assert s.verified == len(PROMPTS) * -(-23 // (k + 1))
    draft = llm.speculator.draft
    # Per verify step one catch-up extend and k - 1 decode steps of the draft (fewer near the length limit).
    assert draft.steps <= s.verify_steps * k


def test_draft_model_from_an_hf_directory(tmp_path) -> None:  # noqa: ANN001
    """The draft given as a directory path (the command line's form) loads through the HF loader."""
    from tests.hf.hf_tiny_models import build_pair, tiny_config
    from transformers import AutoModelForCausalLM

    ours, _ = build_pair("llama", attn="eager")
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=1)).save_pretrained(tmp_path)
    prompts = [[(3 * i + j) % 7 + 1 for j in range(n)] for i, n in enumerate([5, 12, 9])]
    plain = make_llm(ours, max_context=48).generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    spec = make_llm(ours, max_context=48, speculative_config=f'{{"method": "draft_model", "model": "{tmp_path}", '
                                                             f'"num_speculative_tokens": 2}}')
    outs = spec.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert spec.speculator.stats.verify_steps > 0
    assert spec.speculator.config.to_dict()["model"] == str(tmp_path)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"])
def test_hf_families_greedy_identical_with_a_draft_model(family: str) -> None:
    """Each family with a draft model of its own kind and other weights."""
    from tests.hf.hf_tiny_models import build_pair

    ours, _ = build_pair(family, attn="eager")
    draft, _ = build_pair(family, attn="eager", seed=7)
    prompts = [[(3 * i + j) % 7 + 1 for j in range(n)] for i, n in enumerate([5, 12, 9])]
    plain = make_llm(ours, max_context=48).generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    spec = make_llm(ours, max_context=48, speculative_config=draft_config(draft, 2))
    outs = spec.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain], family
    assert spec.speculator.stats.verify_steps > 0


def test_seeded_samples_are_identical_with_a_draft_model(model) -> None:  # noqa: ANN001
    params = [SamplingParams(max_new_tokens=20, temperature=t, top_k=k, seed=s)
              for t, k, s in [(0.2, 0, 1), (0.5, 5, 2), (0.1, 0, 3), (1.5, 20, 4), (0.3, 0, 5)]]
    a = make_llm(model).generate(PROMPTS, params)
    spec = make_llm(model, speculative_config=draft_config(copy.deepcopy(model)))
    b = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert spec.speculator.stats.accepted_tokens > 0


def test_both_pools_are_exact_after_accept_reject_preempt_and_abort(model, small_draft) -> None:  # noqa: ANN001
    llm = make_llm(model, kv_cache_tokens=48, enable_prefix_cache=False,
                   speculative_config=draft_config(copy.deepcopy(small_draft)))
    draft = llm.speculator.draft
    reqs = [llm.add_request(p, SamplingParams(max_new_tokens=16)) for p in PROMPTS[:4]]
    steps = 0
    while llm.has_work():
        llm.step()
        check_pools(llm)
        steps += 1
        if steps == 6:
            llm.abort_request(reqs[1])
    assert llm.scheduler.num_preemptions > 0 and llm.speculator.stats.verify_steps > 0
    assert llm.kv_cache.allocator.available == llm.kv_cache.allocator.num_pages
    assert not draft._rows and draft.kv_cache.allocator.available == draft.kv_cache.allocator.num_pages
    for i in (0, 2, 3):
        assert reqs[i].output_ids == greedy_by_recompute(model, PROMPTS[i], 16)
    assert reqs[1].finish_reason == "abort"


def test_nothing_compiles_on_draft_model_traffic_after_warm_up(model, small_draft) -> None:  # noqa: ANN001
    torch._dynamo.reset()
    llm = make_llm(model, graph_mode="full_and_piecewise", compile=True, compile_options={"compiler": "eager"},
                   speculative_config=draft_config(copy.deepcopy(small_draft)))
    before = compile_counters.snapshot()
    llm.generate(PROMPTS, SamplingParams(max_new_tokens=10))
    delta = compile_counters.delta(before)
    assert delta.get("graphs_seen", 0) == 0 and delta.get("recompiles", 0) == 0, delta
    assert llm.speculator.stats.verify_steps > 0


def test_sampled_outputs_follow_the_target_distribution_with_a_different_draft() -> None:
    """A draft whose weights differ from the target's proposes tokens the target often rejects: the joint
    distribution of the 2nd and 3rd sampled tokens still is the target's (chi-square against the exact one)."""
    small = peaked_model()
    draft = copy.deepcopy(small)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.3 * torch.randn_like(p))
    prompt = [0] + greedy_by_recompute(small, [0], 5)
    joint = joint_of_tokens_2_and_3(small, prompt)
    n = 3000
    llm = make_llm(small, max_batch_size=256, max_num_tokens=2048, kv_cache_tokens=256 * 20, max_context=20,
                   speculative_config=draft_config(draft, 2))
    outs = llm.generate([prompt] * n, SamplingParams(max_new_tokens=4, temperature=1.0), use_tqdm=False)
    s = llm.speculator.stats
    assert n // 10 < s.accepted_tokens < s.draft_tokens - n // 10, s  # drafts both kept and rejected, often
    assert_tokens_2_and_3_follow(outs, joint)


def test_the_draft_options_are_checked(model) -> None:  # noqa: ANN001
    with pytest.raises(EngineOptionError, match="needs 'model'"):
        make_llm(model, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(EngineOptionError, match="'ngram' takes no 'model'"):
        make_llm(model, speculative_config={"method": "ngram", "model": "x", "num_speculative_tokens": 2})
    other = ToyDecoder(ToyDecoderConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                        head_dim=8, intermediate_size=32))
    with pytest.raises(EngineOptionError, match="50 tokens and the target's 97"):
        make_llm(model, speculative_config=draft_config(other))
