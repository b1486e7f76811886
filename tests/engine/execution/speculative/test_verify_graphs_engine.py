"""Chain verify steps in a verify mode, through the engine: greedy tokens with speculation equal plain greedy decoding
(recomputed from scratch) with the triton backend's verify mode on the CPU (interpreted kernels, so eager steps), with
full verify graphs on the CPU (a torch_native test double with a verify mode: tests/graph_runner), and on a GPU
(``gpu``) with the triton backend, whose verify steps must then have replayed the verify graphs.

A draft model proposes K tokens for every request, so its verify steps are uniform (1 + K tokens per request) and take
the verify mode; n-gram proposals differ in length between requests (a request without a match verifies none): in
full verify graphs their tokens take the last rows of their 1 + K (graph_runner/verify_layout.py), eagerly the
extend route. With topk > 1 (draft trees) the engine captures tree verify graphs of 1 + num_draft_tokens tokens per
request, which a draft model's uniform trees replay."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.graph_runner.gr_helpers import VerifyModeNative
from tests.greedy_reference import greedy_by_recompute

import compile_attn.engine.execution.rank_parts as rank_parts
from compile_attn import ForwardMode
from compile_attn.engine import LLM, SamplingParams
from compile_attn.models import ToyDecoder, ToyDecoderConfig

# No sliding window (verify mode needs every layer to see the whole sequence), head_dim 64 (the triton kernels').
CFG = ToyDecoderConfig(vocab_size=53, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                       intermediate_size=64)
DRAFT_CFG = ToyDecoderConfig(vocab_size=53, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64,
                             intermediate_size=32)
PROMPTS = [[(7 * i + j) % 11 for j in range(n)] for i, n in enumerate([3, 17, 9, 30])]
_CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU test (the engine runs on the CPU)")


@pytest.fixture(autouse=True, scope="module")
def _verify_mode_on():  # noqa: ANN202
    """The verify mode is on unless ``COMPILE_ATTN_VERIFY_MODE`` = 0: these tests are about it, whatever the
    environment says."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("COMPILE_ATTN_VERIFY_MODE", raising=False)
        yield


def _toy(cfg: ToyDecoderConfig = CFG, seed: int = 0) -> ToyDecoder:
    torch.manual_seed(seed)
    return ToyDecoder(cfg).eval()


def _draft_spec() -> dict:
    return {"method": "draft_model", "model": _toy(DRAFT_CFG, 1), "num_speculative_tokens": 3}


def _check_greedy(llm: LLM, model: ToyDecoder, prompts: list[list[int]] = PROMPTS, n_new: int = 10) -> None:
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=n_new))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_by_recompute(model, prompt, n_new)
    assert llm.steps_by_mode[ForwardMode.TARGET_VERIFY] > 0


@_CPU
def test_triton_verify_mode_gives_plain_greedy_tokens_on_the_cpu() -> None:
    model = _toy()
    llm = LLM(model, attn_backend="triton", graph_mode="none", compile=False, max_batch_size=4, max_num_tokens=64,
              max_context=64, page_size=4, device="cpu", speculative_config=_draft_spec())
    _check_greedy(llm, model, PROMPTS[1:3], n_new=6)  # few steps: the interpreter is slow
    assert llm.backend.verify.steps > 0  # uniform chain verify steps took the kernel's verify mode


@_CPU
def test_full_verify_graphs_give_plain_greedy_tokens_on_the_cpu(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(rank_parts, "create_backend", lambda name, kv, layers: VerifyModeNative(kv, layers))
    model = _toy()
    llm = LLM(model, graph_mode="full", compile=False, max_batch_size=4, max_num_tokens=64, max_context=64,
              page_size=4, device="cpu", speculative_config=_draft_spec())
    runner = llm.step_runner.runner
    assert runner.verify_tokens == 4 and runner.verify_buckets == (1, 2, 4) and runner.stats.verify_graphs == 3
    _check_greedy(llm, model)
    assert runner.stats.verify_runs > 0 and llm.backend.verify_forwards > 0


@_CPU
def test_prompt_lookup_with_mixed_draft_counts_replays_the_verify_graphs_on_the_cpu(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(rank_parts, "create_backend", lambda name, kv, layers: VerifyModeNative(kv, layers))
    model = _toy()
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(model, graph_mode="full", compile=False, max_batch_size=4, max_num_tokens=64, max_context=64,
              page_size=4, device="cpu", speculative_config=spec, overlap=False)  # overlap off: drafts every step
    runner = llm.step_runner.runner
    seen: list[list[int]] = []
    run = runner.run

    def record(fb, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if fb.forward_mode.is_verify() and runner.verify_route(fb) is not None:
            seen.append(list(fb.extend_seq_lens_cpu))
        return run(fb, *args, **kwargs)

    monkeypatch.setattr(runner, "run", record)
    # periodic prompts: lookups match, with different draft counts per request as the matches run out
    prompts = [[(3 * i + j) % 5 for j in range(n)] for i, n in enumerate([9, 14, 6, 11])]
    _check_greedy(llm, model, prompts, n_new=12)
    assert any(len(set(lens)) > 1 for lens in seen), seen  # mixed draft counts went through the verify graphs
    assert runner.stats.verify_runs == len(seen) > 0


def _tree_spec() -> dict:
    """A draft model's trees: its top 2 tokens at each of 2 depths, so 4 drafts (Q = 5) for every request."""
    return {**_draft_spec(), "num_speculative_tokens": 2, "topk": 2}


@pytest.mark.slow
@_CPU
def test_triton_verify_mode_runs_draft_trees_on_the_cpu() -> None:
    model = _toy()
    llm = LLM(model, attn_backend="triton", graph_mode="none", compile=False, max_batch_size=4, max_num_tokens=64,
              max_context=64, page_size=4, device="cpu", speculative_config=_tree_spec())
    _check_greedy(llm, model, PROMPTS[1:2], n_new=4)  # few steps: the interpreter is slow
    assert llm.backend.verify.tree_steps > 0 and llm.speculator.stats.tree_verified > 0


@_CPU
def test_draft_trees_replay_the_tree_verify_graphs_on_the_cpu(monkeypatch) -> None:  # noqa: ANN001
    """topk > 1: the engine captures tree verify graphs of 1 + num_draft_tokens tokens per request; its tree verify
    steps replay them (none captured on first traffic) and the greedy tokens are plain greedy decoding's."""
    monkeypatch.setattr(rank_parts, "create_backend", lambda name, kv, layers: VerifyModeNative(kv, layers))
    model = _toy()
    llm = LLM(model, graph_mode="full", compile=False, max_batch_size=4, max_num_tokens=64, max_context=64,
              page_size=4, device="cpu", speculative_config=_tree_spec())
    runner = llm.step_runner.runner
    assert runner.verify_tokens == 5 and runner.verify_trees and runner.verify_buckets == (1, 2, 4)
    captures = dict(runner.stats.captures)
    trees = []
    run = runner.run

    def record(fb, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if fb.draft_parents is not None and runner.verify_route(fb) is not None:
            trees.append(fb.draft_parents)
        return run(fb, *args, **kwargs)

    monkeypatch.setattr(runner, "run", record)
    _check_greedy(llm, model, n_new=6)
    assert trees and runner.stats.verify_runs >= len(trees) and llm.backend.tree_forwards > 0
    assert any(parents != tuple(range(-1, 4)) for step in trees for parents in step)  # real trees, not chains
    assert dict(runner.stats.captures) == captures


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_verify_steps_replay_the_verify_graphs_on_a_gpu() -> None:
    """bf16 on a GPU, a draft model (K drafts for every request): tokens equal HF's greedy ones up to the first
    near-tie, and the chain verify steps replayed the verify graphs."""
    from tests.engine.bf16_reference import greedy_up_to_first_tie, small_llama

    model = small_llama()
    prompts = [([(13 * i + 7 * j) % 1024 for j in range(8)] * 4)[:n] for i, n in enumerate([9, 24, 32, 17])]
    refs = [greedy_up_to_first_tie(model, p, 24) for p in prompts]
    draft = copy.deepcopy(model)  # the target's weights with noise: a draft that is often, not always, right
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * p.float().std() * torch.randn_like(p))
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4}
    llm = LLM(model, attn_backend="triton", max_batch_size=8, max_context=256, max_num_tokens=256,
              speculative_config=spec)
    runner = llm.step_runner.runner
    assert runner.plan.decode.value == "full" and runner.verify_tokens == 5 and runner.stats.verify_graphs > 0
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    for out, (ref, first_tie) in zip(outs, refs):
        assert out.token_ids[:first_tie] == ref[:first_tie], f"first undecidable position {first_tie}"
    assert runner.stats.verify_runs > 0  # (steps near max_new_tokens may verify fewer drafts: decode rows)
    assert llm.backend.verify.steps >= runner.stats.verify_runs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_tree_verify_steps_replay_the_tree_verify_graphs_on_a_gpu() -> None:
    """bf16 on a GPU, a draft model's trees (topk 2 at each of 3 depths: 6 drafts, Q = 7): tokens equal HF's greedy
    ones up to the first near-tie, and the tree verify steps replayed the tree verify graphs."""
    from tests.engine.bf16_reference import greedy_up_to_first_tie, small_llama

    model = small_llama()
    prompts = [([(13 * i + 7 * j) % 1024 for j in range(8)] * 4)[:n] for i, n in enumerate([9, 24, 32, 17])]
    refs = [greedy_up_to_first_tie(model, p, 24) for p in prompts]
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * p.float().std() * torch.randn_like(p))
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "topk": 2}
    llm = LLM(model, attn_backend="triton", max_batch_size=8, max_context=256, max_num_tokens=256,
              speculative_config=spec)
    runner = llm.step_runner.runner
    assert runner.plan.decode.value == "full" and runner.verify_tokens == 7 and runner.verify_trees
    assert runner.stats.verify_graphs > 0
    captures = dict(runner.stats.captures)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    for out, (ref, first_tie) in zip(outs, refs):
        assert out.token_ids[:first_tie] == ref[:first_tie], f"first undecidable position {first_tie}"
    assert runner.stats.verify_runs > 0 and llm.backend.verify.tree_steps > 0
    assert dict(runner.stats.captures) == captures  # nothing captured on speculative traffic
