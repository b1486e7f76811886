"""Prefix caching in the engine on the CPU: greedy tokens with the cache are HF ``generate``'s and the cache-off
engine's for the six HF families (no graphs, and full + piecewise graphs, overlap on); the tokens the model computes
(summed from the batches the engine runs) drop by exactly the tokens the cache reports reused, and by at least the
shared prefix of each request; a repeated call computes only each prompt's last (partial) page. Random request sets
with overlapping prefixes, staggered arrivals, aborts, and a cache small enough to evict and preempt (page sizes 1
and 4) get the recompute reference's tokens, and every page is accounted for after every step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_attn.engine import LLM, SamplingParams
from compile_attn.models import ToyDecoder, ToyDecoderConfig
from compile_attn.kv.page_account import page_account
from tests.greedy_reference import greedy_by_recompute
from tests.hf.hf_tiny_models import FAMILIES, build_pair, hf_greedy

SHARED = [(7 * j + 3) % 96 for j in range(21)]
FIRST = SHARED + [5, 6, 7]
PROMPTS = [SHARED + [(5 * i + 3 * j + 1) % 96 for j in range(n)] for i, n in enumerate([2, 9, 5, 14])]
PROMPTS += [SHARED + SHARED[:4]]
N_NEW = 6
PAGE = 4


class ComputedTokens:
    """Counts the tokens of every batch the engine runs through the model (its step runner's input)."""

    def __init__(self, llm: LLM) -> None:
        self.total = 0
        real = llm.step_runner.run

        def run(fb, keep, *feed):  # noqa: ANN001, ANN202
            self.total += sum(fb.extend_seq_lens_cpu)
            return real(fb, keep, *feed)

        llm.step_runner.run = run

    def take(self) -> int:
        total, self.total = self.total, 0
        return total


def generate_checked(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """``generate`` by ``add_request`` and ``step``, checking the page account after every step."""
    reqs = [llm.add_request(p, params) for p in prompts]
    while llm.has_work():
        llm.step()
        page_account(llm.kv_cache)
    account = page_account(llm.kv_cache)
    assert account.running == 0 and account.free + account.cached_only == account.total
    assert llm.kv_cache.available_pages == account.total
    return [r.output_ids for r in reqs]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest):  # noqa: ANN201
    ours, stock = build_pair(request.param, attn="eager")
    return request.param, ours, [hf_greedy(stock, p, N_NEW) for p in [FIRST] + PROMPTS]


@pytest.mark.parametrize(("graph_mode", "compile"), [("none", False), ("full_and_piecewise", True)])
def test_cache_on_matches_off_and_computes_fewer_tokens(family, graph_mode: str, compile: bool) -> None:  # noqa: ANN001
    name, model, refs = family
    params = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    computed, outs = {}, {}
    for on in (False, True):
        llm = LLM(model, graph_mode=graph_mode, compile=compile, compile_options={"compiler": "eager"},
                  max_batch_size=4, max_num_tokens=32, max_context=64, page_size=PAGE, device="cpu",
                  enable_prefix_cache=on)
        assert (llm.kv_cache.prefix_cache is not None) == on and llm.overlap
        counter = ComputedTokens(llm)
        first = generate_checked(llm, [FIRST], params)  # caches SHARED (and more) for the next call
        counter.take()
        outs[on] = first + generate_checked(llm, PROMPTS, params)
        computed[on] = counter.take()
        if on:
            cache = llm.kv_cache.prefix_cache
            hits = cache.num_hit_tokens
            assert hits >= len(PROMPTS) * (len(SHARED) // PAGE * PAGE)  # each request found SHARED at least
            again = generate_checked(llm, PROMPTS, params)
            assert again == outs[on][1:]
            # every prompt is cached now: only its last page computes (the last token at least), then decodes
            last_pages = sum(len(p) - (len(p) - 1) // PAGE * PAGE for p in PROMPTS)
            assert counter.take() == last_pages + len(PROMPTS) * (N_NEW - 1)
    assert outs[True] == outs[False] == refs, f"{name} {graph_mode}"
    assert computed[False] - computed[True] == hits, "the model computed more than the uncached tokens"


CFG = ToyDecoderConfig(vocab_size=53, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64, sliding_window=7)


@pytest.fixture(scope="module")
def toy() -> ToyDecoder:
    torch.manual_seed(0)
    return ToyDecoder(CFG).eval()


STEMS = [[(11 * j + 5) % 53 for j in range(30)], [(3 * j + 1) % 53 for j in range(30)]]
requests = st.lists(
    st.tuples(st.integers(0, 1), st.integers(0, 24), st.lists(st.integers(0, 52), max_size=5),
              st.integers(1, 5), st.integers(0, 6)),  # stem, its tokens kept, own tail, new tokens, arrival step
    min_size=1, max_size=7,
)


@settings(max_examples=20, deadline=None)
@given(requests, st.sampled_from([1, 4]), st.sampled_from([40, 64, 512]), st.booleans(), st.integers(-1, 6))
def test_random_overlapping_prompts_under_eviction_and_preemption(toy: ToyDecoder, reqs, page_size: int,  # noqa: ANN001
                                                                   kv_tokens: int, overlap: bool,
                                                                   abort_at: int) -> None:
    llm = LLM(toy, graph_mode="none", compile=False, max_batch_size=4, max_num_tokens=16, max_context=40,
              kv_cache_tokens=kv_tokens, page_size=page_size, device="cpu", overlap=overlap)
    prompts = [STEMS[s][:k] + tail or [1] for s, k, tail, _, _ in reqs]
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i][4])
    started, aborted = {}, None
    step = 0
    while pending or llm.has_work():
        while pending and reqs[pending[0]][4] <= step:
            i = pending.pop(0)
            started[i] = llm.add_request(prompts[i], SamplingParams(max_tokens=reqs[i][3], ignore_eos=True))
        if step == abort_at and started and aborted is None:
            aborted = max(started)
            llm.abort_request(started[aborted])
        llm.step()
        account = page_account(llm.kv_cache)
        assert account.running == 0 or llm.has_work()
        step += 1
    for i, r in started.items():
        if i != aborted:
            assert r.output_ids == greedy_by_recompute(toy, prompts[i], reqs[i][3]), (i, prompts[i])
    account = page_account(llm.kv_cache)
    assert account.running == 0 and account.free + account.cached_only == account.total
    llm.kv_cache.enable_prefix_cache(False)  # empties the tree: every page free again
    assert llm.kv_cache.allocator.available == account.total


def test_second_generate_computes_only_each_prompts_last_token(toy: ToyDecoder) -> None:
    llm = LLM(toy, graph_mode="none", compile=False, max_batch_size=4, max_num_tokens=64, max_context=48,
              page_size=1, device="cpu")
    counter = ComputedTokens(llm)
    prompts = [STEMS[0][:20], STEMS[1][:25], STEMS[0][:9] + [1, 2, 3]]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = [o.token_ids for o in llm.generate(prompts, params)]
    assert counter.take() == sum(map(len, prompts)) + len(prompts) * 3  # one step admits all: nothing cached yet
    second = [o.token_ids for o in llm.generate(prompts, params)]
    assert second == first == [greedy_by_recompute(toy, p, 4) for p in prompts]
    assert counter.take() == len(prompts) + len(prompts) * 3  # one prompt token each, then three decode steps
    assert llm.kv_cache.prefix_cache.num_hit_tokens == sum(map(len, prompts)) - len(prompts)
    llm.kv_cache.enable_prefix_cache(False)
    llm.generate(prompts, params)
    assert counter.take() == sum(map(len, prompts)) + len(prompts) * 3  # off: every prompt token again


def test_cached_pages_are_evicted_before_anyone_is_preempted(toy: ToyDecoder) -> None:
    llm = LLM(toy, graph_mode="none", compile=False, max_batch_size=4, max_num_tokens=64, max_context=48,
              kv_cache_tokens=48, page_size=4, device="cpu")
    cache = llm.kv_cache.prefix_cache
    llm.generate([STEMS[0][:30]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert page_account(llm.kv_cache).cached_only >= 7  # the prompt's 7 whole pages at least, of 12
    prompts = [STEMS[1][:14], [(5 * j + 2) % 53 for j in range(14)]]  # nothing in common with the first
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # 10 pages: some must be evicted
    assert [o.token_ids for o in outs] == [greedy_by_recompute(toy, p, 4) for p in prompts]
    assert llm.scheduler.num_preemptions == 0 and cache.num_hit_tokens == 0
    _, left = cache.tree.match(np.array(STEMS[0][:30]))
    assert len(left) < 7  # the first prompt's pages made the room


def test_requests_starting_together_share_their_prefix(toy: ToyDecoder) -> None:
    """The n samples of one prompt, and prompts behind one long system prompt, arriving together: the first computes
    the shared prefix, the others wait one step and take it from the cache (counted), with the same tokens."""
    system = [(7 * j + 3) % 53 for j in range(36)]
    prompts = [system + [1, 2], system + [4, 5, 6], system[:20] + [9]]
    params = SamplingParams(max_tokens=3, ignore_eos=True, n=3, temperature=0.8, seed=5)
    outs = {}
    for on in (False, True):
        llm = LLM(toy, graph_mode="none", compile=False, max_batch_size=12, max_num_tokens=512, max_context=48,
                  page_size=4, device="cpu", enable_prefix_cache=on)
        counter = ComputedTokens(llm)
        outs[on] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
        computed = counter.take()
        if on:
            hits = llm.kv_cache.prefix_cache.num_hit_tokens
            # 36 system tokens (9 pages) for 5 of the 6 samples behind it; the short prompt's 3 samples share 20 - 1
            # tokens rounded down to pages with nothing (it is below the share length): they all compute it
            assert hits == 5 * 36, hits
        outs[on].append(computed)
    assert outs[True][:3] == outs[False][:3]
    assert outs[False][3] - outs[True][3] == 5 * 36  # the model computed exactly the tokens it did not reuse
