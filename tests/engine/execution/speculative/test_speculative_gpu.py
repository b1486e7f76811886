"""Speculative decoding on the GPU (bf16): greedy tokens with n-gram chains equal HF's greedy tokens up to the first
near-tie, in every backend, with verify steps replayed from the full decode graphs."""

from __future__ import annotations

import copy

import pytest
import torch

from compile_attn import ForwardMode
from compile_attn.attention.registry import module_available
from compile_attn.engine import LLM, SamplingParams
from tests.engine.bf16_reference import greedy_up_to_first_tie, small_llama

pytestmark = pytest.mark.gpu
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.mark.parametrize("backend", [
    "triton", "torch_native",
    pytest.param("flashinfer", marks=pytest.mark.skipif(not module_available("flashinfer"), reason="no flashinfer")),
    pytest.param("fa3", marks=pytest.mark.skipif(not module_available("sgl_kernel"), reason="needs sgl_kernel")),
    pytest.param("flashinfer+triton", marks=pytest.mark.skipif(not module_available("flashinfer"),
                                                               reason="no flashinfer")),
])
def test_greedy_with_ngram_chains_matches_hf(backend: str) -> None:
    model = small_llama()
    # Prompts that repeat a phrase, so prompt lookup has something to propose.
    prompts = [([(13 * i + 7 * j) % 1024 for j in range(8)] * 4)[: n] for i, n in enumerate([9, 24, 32, 17])]
    n_new = 24
    refs = [greedy_up_to_first_tie(model, p, n_new) for p in prompts]
    llm = LLM(model, attn_backend=backend, max_batch_size=8, max_context=256, max_num_tokens=256,
              speculative_config=NGRAM)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=n_new, ignore_eos=True))
    for out, (ref, first_tie) in zip(outs, refs):
        assert out.token_ids[:first_tie] == ref[:first_tie], f"first undecidable position {first_tie}, {backend}"
    assert sum(first_tie for _, first_tie in refs) >= 8
    stats, runner = llm.speculator.stats, llm.step_runner.runner
    assert stats.verify_steps > 0 and llm.steps_by_mode[ForwardMode.TARGET_VERIFY] > 0
    if runner.plan.decode.value == "full":  # verify steps replay decode graphs: every verify step ran in one
        assert runner.stats.runs["full"] >= llm.steps_by_mode[ForwardMode.DECODE] + llm.steps_by_mode[
            ForwardMode.TARGET_VERIFY]


@pytest.mark.parametrize("topk", [1, 3])
@pytest.mark.parametrize("backend", [
    "triton",
    pytest.param("flashinfer", marks=pytest.mark.skipif(not module_available("flashinfer"), reason="no flashinfer")),
])
def test_greedy_with_a_draft_model_matches_hf(backend: str, topk: int) -> None:
    """A draft model (chains, and trees of its top-3 per depth) on the GPU: the target's HF greedy tokens up to the
    first near-tie, the draft's K steps in full decode graphs."""
    model = small_llama()
    draft = copy.deepcopy(model)  # the target's weights with noise: a draft that is often, not always, right
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * p.float().std() * torch.randn_like(p))
    prompts = [[(13 * i + 7 * j) % 1024 for j in range(n)] for i, n in enumerate([9, 24, 32, 17])]
    n_new = 24
    refs = [greedy_up_to_first_tie(model, p, n_new) for p in prompts]
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4}
    if topk > 1:
        spec.update(topk=topk, num_draft_tokens=8)
    llm = LLM(model, attn_backend=backend, max_batch_size=8, max_context=256, max_num_tokens=256,
              speculative_config=spec)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=n_new, ignore_eos=True))
    for out, (ref, first_tie) in zip(outs, refs):
        assert out.token_ids[:first_tie] == ref[:first_tie], f"first undecidable position {first_tie}, {backend}"
    stats = llm.speculator.stats
    assert stats.verify_steps > 0 and llm.speculator.draft.steps > 0
    assert stats.accepted_tokens > 0 and (stats.tree_verified > 0) == (topk > 1)
