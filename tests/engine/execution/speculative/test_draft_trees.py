"""Draft trees: the acceptance walk against its definition, prompt-lookup trees against brute force, the draft
model's top-k tree selection, the accepted path's KV moved into place, and the engine with trees (greedy outputs
identical in every graph mode, n-gram and draft-model trees, pools exact, sampled outputs following the target)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_attn.draft_tree import depths
from compile_attn.engine import SamplingParams
from compile_attn.engine.execution.speculative.acceptance import accept_chain, accept_tree
from compile_attn.engine.execution.speculative.draft_model import top_k_tree
from compile_attn.engine.execution.speculative.ngram import NgramProposer
from compile_attn.engine.execution.speculative.tree_kv import move_accepted_path
from compile_attn.kv.cache import KVCache
from compile_attn.models import ToyDecoder
from tests.engine.execution.speculative.test_draft_model_engine import check_pools
from tests.engine.execution.speculative.target_distribution import (
    assert_tokens_2_and_3_follow, joint_of_tokens_2_and_3, peaked_model)
from tests.engine.execution.speculative.test_speculative_engine import CFG, PROMPTS, make_llm
from tests.greedy_reference import greedy_by_recompute


@st.composite
def trees(draw: st.DrawFn) -> tuple[list[int], list[int], list[int]]:
    """(drafts, parents, targets): a random tree whose siblings draft distinct tokens, and a target per node."""
    n = draw(st.integers(0, 8))
    parents, drafts, used = [], [], {}
    for i in range(n):
        parent = draw(st.integers(-1, i - 1))
        taken = used.setdefault(parent, set())
        free = [t for t in range(4) if t not in taken]
        if not free:
            continue
        tok = draw(st.sampled_from(free))
        taken.add(tok)
        parents.append(parent)
        drafts.append(tok)
    targets = draw(st.lists(st.integers(0, 3), min_size=len(drafts) + 1, max_size=len(drafts) + 1))
    return drafts, parents, targets


@settings(max_examples=300, deadline=None)
@given(tree=trees())
def test_tree_acceptance_follows_the_target_token_at_each_node(tree) -> None:  # noqa: ANN001
    drafts, parents, targets = tree
    tokens, nodes = accept_tree(drafts, parents, targets)
    assert nodes[0] == 0 and tokens == [targets[n] for n in nodes]
    for d in range(1, len(nodes)):  # each step goes to the child drafting the target's token at its parent
        node = nodes[d]
        assert parents[node - 1] + 1 == nodes[d - 1] and drafts[node - 1] == targets[nodes[d - 1]]
    last = nodes[-1]  # and stops where no child drafts it
    assert not any(p + 1 == last and t == targets[last] for p, t in zip(parents, drafts))
    assert depths([-1] + [p + 1 for p in parents])[last] == len(nodes) - 1
    chain = list(range(-1, len(drafts) - 1))  # a chain walks as accept_chain does
    assert accept_tree(drafts, chain, targets)[0] == accept_chain(drafts, targets)


def paths(drafts: list[int], parents: list[int]) -> list[list[int]]:
    out = []
    for i in range(len(drafts)):
        path, node = [], i
        while node >= 0:
            path.append(drafts[node])
            node = parents[node]
        out.append(path[::-1])
    return out


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40), k=st.integers(1, 5), topk=st.integers(1, 4),
       nodes=st.integers(1, 12), lo=st.integers(1, 3))
def test_prompt_lookup_trees_hold_the_continuations_of_the_matches(tokens, k, topk, nodes, lo) -> None:  # noqa: ANN001
    proposer = NgramProposer(k, lo, lo + 2)
    drafts, parents = proposer.propose_tree(tokens, k, topk, nodes)
    assert len(drafts) == len(parents) <= nodes and all(-1 <= p < i for i, p in enumerate(parents))
    # Brute force: the match ends by the definition (longest n first, latest first), their continuations.
    length, ends = len(tokens), []
    for n in range(min(lo + 2, length - 1), lo - 1, -1):
        for end in range(length - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == tokens[length - n :] and end not in ends:
                ends.append(end)
    conts = [tokens[e + 1 : e + 1 + k] for e in ends[:topk]] if length > lo else []
    found = paths(drafts, parents)
    assert len({tuple(p) for p in found}) == len(found)  # no two nodes with the same path (a trie)
    for path in found:  # every node lies on a continuation
        assert any(c[: len(path)] == path for c in conts)
    if len(drafts) < nodes:  # nothing was cut: every continuation is in the tree
        assert all(not c or c in found for c in conts)
    if conts and conts[0]:  # the first (longest, latest) match's continuation is the chain proposal's
        assert proposer.propose(tokens)[: len(drafts)] == conts[0][: len(drafts)]


@settings(max_examples=200, deadline=None)
@given(depth=st.integers(1, 5), topk=st.integers(2, 4), cap=st.integers(0, 20), seed=st.integers(0, 10**6))
def test_top_k_tree_keeps_the_best_paths_as_a_tree(depth: int, topk: int, cap: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    logprobs = [sorted(np.log(rng.dirichlet(np.ones(10)))[:topk].tolist(), reverse=True) for _ in range(depth)]
    logprobs = [sorted(lp, reverse=True) for lp in logprobs]
    tokens = [rng.permutation(10)[:topk].tolist() for _ in range(depth)]
    drafts, parents = top_k_tree(tokens, logprobs, cap)
    assert len(drafts) == min(cap, depth * topk)
    chain_lp = np.cumsum([lp[0] for lp in logprobs])
    score = {}
    for d in range(depth):
        for r in range(topk):
            score[(d, r)] = (chain_lp[d - 1] if d else 0.0) + logprobs[d][r]
    d_of = [d - 1 for d in depths([-1] + [p + 1 for p in parents])[1:]]
    kept = set()
    for tok, parent, d in zip(drafts, parents, d_of):
        kept.add((d, tokens[d].index(tok)))  # the tokens of one depth are distinct
        if d == 0:
            assert parent == -1
        else:  # the parent is the chain's node one depth up
            assert d_of[parent] == d - 1 and drafts[parent] == tokens[d - 1][0]
    assert len(kept) == len(drafts)
    worst_kept = min((score[c] for c in kept), default=np.inf)
    assert all(score[c] <= worst_kept + 1e-12 for c in score if c not in kept)


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_accepted_path_moves_into_place(page_size: int) -> None:
    kv = KVCache(num_layers=2, num_kv_heads=1, head_dim=2, max_batch_size=2, max_context=32, kv_cache_tokens=32,
                 page_size=page_size, dtype=torch.float32)
    row = kv.alloc_request()
    loc = kv.alloc_extend([row], [12])
    for layer in range(2):  # every position's K and V tell which position and layer they belong to
        value = torch.arange(12, dtype=torch.float32)[:, None, None].expand(12, 1, 2) + 100 * layer
        kv.pool.set_kv(layer, loc, value, -value)
    base, nodes = 5, [0, 2, 3, 6]  # root at 5, then the nodes at 7, 8, 11 move to 6, 7, 8
    assert move_accepted_path(kv, row, base, nodes)
    slots = torch.tensor([kv.req_to_token[row, p].item() for p in range(12)])
    for layer in range(2):
        got = kv.pool.k_buffers[layer][slots, 0, 0]
        want = [float(p) for p in range(5)] + [float(base + n) for n in nodes] + [9.0, 10.0, 11.0]
        assert (got - 100 * layer).tolist() == want
        assert torch.equal(kv.pool.v_buffers[layer][slots, 0, 0], -kv.pool.k_buffers[layer][slots, 0, 0])
    assert not move_accepted_path(kv, row, base, [0, 1, 2])  # a path already in place: nothing to do


# ---------------------------------------------------------------------------- the engine with trees
NGRAM_TREE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
              "topk": 3, "num_draft_tokens": 7}




@pytest.fixture(scope="module")
def model() -> ToyDecoder:
    torch.manual_seed(0)
    return ToyDecoder(CFG).eval()


def noisy_copy(model: torch.nn.Module, scale: float, seed: int = 0) -> torch.nn.Module:
    """A draft close to the target: its weights plus noise (accepts often, not always)."""
    torch.manual_seed(seed)
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn_like(p))
    return out


@pytest.mark.parametrize(("graph_mode", "compile"), [("none", False), ("full", False), ("breakable", False),
                                                      ("full_and_piecewise", True)])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_outputs_are_identical_with_trees(model, method, graph_mode, compile) -> None:  # noqa: ANN001
    spec = NGRAM_TREE if method == "ngram" else {"method": "draft_model", "model": noisy_copy(model, 0.05),
                                                 "num_speculative_tokens": 3, "topk": 3, "num_draft_tokens": 7}
    llm = make_llm(model, graph_mode=graph_mode, compile=compile, max_num_tokens=64,
                   compile_options={"compiler": "eager", "verify": True} if compile else {"verify": True},
                   speculative_config=spec)
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=16))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == greedy_by_recompute(model, prompt, 16)
    s = llm.speculator.stats
    # Prompt lookup branches only where a suffix recurs with different continuations; a draft model always does.
    assert s.verify_steps > 0 and s.accepted_tokens > 0 and (s.tree_verified > 0 or method == "ngram")


@pytest.mark.parametrize("page_size", [1, 4])
def test_pools_are_exact_with_trees_through_preempt_and_abort(model, page_size: int) -> None:  # noqa: ANN001
    llm = make_llm(model, kv_cache_tokens=64, page_size=page_size, max_num_tokens=64, enable_prefix_cache=False,
                   speculative_config={"method": "draft_model", "model": noisy_copy(model, 0.05),
                                       "num_speculative_tokens": 3, "topk": 2})
    reqs = [llm.add_request(p, SamplingParams(max_new_tokens=16)) for p in PROMPTS[:4]]
    steps = 0
    while llm.has_work():
        llm.step()
        check_pools(llm)
        steps += 1
        if steps == 6:
            llm.abort_request(reqs[1])
    assert llm.kv_cache.allocator.available == llm.kv_cache.allocator.num_pages
    for i in (0, 2, 3):
        assert reqs[i].output_ids == greedy_by_recompute(model, PROMPTS[i], 16)


def test_seeded_samples_are_identical_with_trees(model) -> None:  # noqa: ANN001
    params = [SamplingParams(max_new_tokens=16, temperature=t, top_k=k, seed=s)
              for t, k, s in [(0.2, 0, 1), (0.5, 5, 2), (0.1, 0, 3), (1.5, 20, 4), (0.3, 0, 5)]]
    a = make_llm(model).generate(PROMPTS, params)
    spec = make_llm(model, max_num_tokens=64, speculative_config={
        "method": "draft_model", "model": noisy_copy(model, 0.05), "num_speculative_tokens": 3, "topk": 3})
    b = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert spec.speculator.stats.accepted_tokens > 0 and spec.speculator.stats.tree_verified > 0


def test_sampled_outputs_follow_the_target_distribution_with_trees() -> None:
    """Draft-model trees (top-3 at each depth of a draft close to the target) verified by sampling: the joint
    distribution of the 2nd and 3rd tokens is the target's (chi-square against the exact one)."""
    small = peaked_model()
    draft = noisy_copy(small, 0.3, seed=1)
    prompt = [0] + greedy_by_recompute(small, [0], 5)
    joint = joint_of_tokens_2_and_3(small, prompt)
    n = 2000
    llm = make_llm(small, max_batch_size=256, max_num_tokens=4096, kv_cache_tokens=256 * 24, max_context=24,
                   speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2,
                                       "topk": 3})
    outs = llm.generate([prompt] * n, SamplingParams(max_new_tokens=4, temperature=1.0), use_tqdm=False)
    s = llm.speculator.stats
    assert s.accepted_tokens > n // 5, s
    assert_tokens_2_and_3_follow(outs, joint)
