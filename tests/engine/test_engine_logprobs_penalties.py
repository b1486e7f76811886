"""Logprobs and penalties through the engine (CPU, fp32): each returned logprob equals a float64 log-softmax of the
stock HF model's logits for the same prefix (teacher-forced), with the top tokens and the sampled token's rank; and
greedy tokens under presence / frequency / repetition penalties equal an independent float64 loop that recomputes
the whole sequence each step and penalises by the OpenAI / vLLM definition. Both with overlap on and off, in batches
that mix requests with and without them, and through preemption in a small KV cache."""

from __future__ import annotations

import math

import pytest
import torch

from compile_attn.engine import LLM, SamplingParams
from tests.hf.hf_tiny_models import build_pair

PROMPTS = [[(5 * i + 3 * j + 1) % 96 for j in range(n)] for i, n in enumerate([3, 12, 7, 20, 5])]


@pytest.fixture(scope="module")
def pair():  # noqa: ANN201
    return build_pair("llama", attn="eager")


def full_logits(stock: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return stock(torch.tensor([ids])).logits[0].double()


def penalised_greedy(stock: torch.nn.Module, prompt: list[int], n: int, presence: float, frequency: float,
                     repetition: float) -> list[int]:
    """float64 reference: repetition on tokens seen in prompt or output (divide positive logits, multiply negative
    ones), then minus frequency * count and presence * (count > 0) over the output's tokens."""
    out: list[int] = []
    for _ in range(n):
        logits = full_logits(stock, prompt + out)[-1].clone()
        seen = set(prompt) | set(out)
        for t in seen:
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        out.append(int(logits.argmax()))
    return out


def engine(model: torch.nn.Module, **kw) -> LLM:
    args = dict(graph_mode="full", compile=False, max_batch_size=4, max_num_tokens=32, max_context=64, page_size=4,
                device="cpu")
    return LLM(model, **{**args, **kw})


@pytest.mark.parametrize("overlap", [True, False])
def test_logprobs_equal_float64_log_softmax_of_hf(pair, overlap: bool) -> None:  # noqa: ANN001
    model, stock = pair
    llm = engine(model, overlap=overlap)
    params = [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3), SamplingParams(max_tokens=4, ignore_eos=True),
              SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0, temperature=0.9, seed=4),
              SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1)]
    outs = llm.generate(PROMPTS[:4], params)
    assert outs[1].outputs[0].logprobs is None
    for o, p, prompt in zip(outs, params, PROMPTS):
        if p.logprobs is None:
            continue
        lps = o.outputs[0].logprobs
        assert len(lps) == len(o.token_ids) == p.max_tokens
        logits = full_logits(stock, prompt + o.token_ids)
        for pos, (tok, entry) in enumerate(zip(o.token_ids, lps)):
            ref = torch.log_softmax(logits[len(prompt) - 1 + pos], dim=-1)
            assert next(iter(entry)) == tok  # the sampled token first
            assert math.isclose(entry[tok].logprob, float(ref[tok]), abs_tol=1e-4)
            assert entry[tok].rank == 1 + int((ref > ref[tok]).sum())
            top = ref.topk(p.logprobs)
            for rank, (lp, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
                assert math.isclose(entry[t].logprob, lp, abs_tol=1e-4)
                if t != tok:
                    assert entry[t].rank == rank
            assert len(entry) == len(set(top.indices.tolist()) | {tok})
    greedy = outs[0]
    assert all(e[t].rank == 1 for t, e in zip(greedy.token_ids, greedy.outputs[0].logprobs))


@pytest.mark.parametrize("overlap", [True, False])
def test_penalised_greedy_equals_float64_reference(pair, overlap: bool) -> None:  # noqa: ANN001
    model, stock = pair
    llm = engine(model, overlap=overlap)
    settings = [(0.5, 0.3, 1.3), (0.0, 0.0, 1.0), (0.0, 1.5, 1.0), (1.0, 0.0, 0.7), (0.0, 0.0, 1.6)]
    params = [SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=pr, frequency_penalty=fr,
                             repetition_penalty=rp) for pr, fr, rp in settings]
    outs = llm.generate(PROMPTS, params)
    refs = [penalised_greedy(stock, p, 10, *s) for p, s in zip(PROMPTS, settings)]
    assert [o.token_ids for o in outs] == refs
    plain = [penalised_greedy(stock, p, 10, 0.0, 0.0, 1.0) for p in PROMPTS]
    assert sum(r != q for r, q in zip(refs, plain)) >= 3, "the penalties were meant to change most outputs"
    # the same requests again on the same engine: rows are reused, statistics start over
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == refs


def test_penalties_survive_preemption(pair) -> None:  # noqa: ANN001
    model, stock = pair
    llm = engine(model, max_num_tokens=16, kv_cache_tokens=48, max_context=48)
    params = SamplingParams(max_tokens=10, ignore_eos=True, frequency_penalty=0.8, repetition_penalty=1.2)
    outs = llm.generate(PROMPTS, params)
    assert llm.scheduler.num_preemptions > 0, "the cache was meant to be too small for every request at once"
    assert [o.token_ids for o in outs] == [penalised_greedy(stock, p, 10, 0.0, 0.8, 1.2) for p in PROMPTS]
