"""The decode kernel's verify mode with a draft tree (``tree_mask``: per query row, the bits of the request's last Q
keys it sees) against a float64 reference written from the definition: token t of a request sees every key before its
last Q, and of those Q the ones at its ancestors (walking ``parents`` to the root) and itself. Random trees from
seeded parents, page sizes 1 and 4, GQA, split counts that cut through the draft region; a chain's bits give the chain
kernel's output bit for bit; bit 63 (64 tokens) is read as a bit, not a sign.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.attention.kernels.kernel_reference import DEVICE, TOLERANCE, make_paged_cache, reference_attention, rel_err
from tests.attention.kernels.test_verify_decode_attention import csr

from compile_attn.attention.kernels import decode_attention_fwd, decode_semaphores
from compile_attn.attention.kernels.decode_attention import SPLIT_ALIGN


def ancestors(parents: list[int], t: int) -> set[int]:
    """``t`` and every token on its way to the root."""
    seen = {t}
    while parents[t] >= 0:
        t = parents[t]
        seen.add(t)
    return seen


def bits_of(parents: list[int]) -> list[int]:
    """Each token's ancestor set as an int64 word (two's complement for bit 63), from ``ancestors``."""
    words = [sum(1 << a for a in ancestors(parents, t)) for t in range(len(parents))]
    return [w - (1 << 64) if w >= 1 << 63 else w for w in words]


def random_parents(q: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, q)]


def reference_tree(cache, q: torch.Tensor, trees: list[list[int]], sm_scale: float, logit_cap: float = 0.0):
    """float64 ``[B * Q, Hq, Dv]``: row b*Q + t over request b's prefix keys and its ancestors among the last Q."""
    tokens = len(trees[0])
    outs = []
    for b, (length, parents) in enumerate(zip(cache.lengths, trees)):
        slots = cache.slots(b)
        allowed = torch.zeros(tokens, length, dtype=torch.bool)
        allowed[:, : length - tokens] = True
        for t in range(tokens):
            for a in ancestors(parents, t):
                allowed[t, length - tokens + a] = True
        outs.append(reference_attention(q[b * tokens:(b + 1) * tokens], cache.k_buffer[slots], cache.v_buffer[slots],
                                        allowed.to(DEVICE), sm_scale, logit_cap))
    return torch.cat(outs)


def run_tree(cache, q, splits, max_kv_splits, tokens, mask, *, one_launch: bool, logit_cap: float = 0.0):
    """decode_attention_fwd in verify mode into NaN-poisoned output and scratch."""
    rows, heads, _ = q.shape
    v_dim = cache.v_buffer.shape[-1]
    out = torch.full((rows, heads, v_dim), float("nan"), dtype=q.dtype, device=DEVICE)
    logits = torch.full((rows, heads, max_kv_splits, v_dim), float("nan"), device=DEVICE)
    lse = torch.full((rows, heads, max_kv_splits), float("nan"), device=DEVICE)
    sem = decode_semaphores(rows, heads, DEVICE) if one_launch else None
    indptr, indices = csr(cache)
    decode_attention_fwd(q, cache.k_buffer, cache.v_buffer, out, indptr, indices, splits, max_kv_splits, logits, lse,
                         0.125, logit_cap, semaphores=sem, tokens_per_request=tokens, tree_mask=mask)
    return out


@st.composite
def tree_cases(draw: st.DrawFn) -> dict:
    tokens = draw(st.sampled_from([2, 4, 7]))
    bs = draw(st.integers(1, 3))
    # prefixes anywhere, or so that a split boundary (SPLIT_ALIGN) falls inside the draft region
    near_boundary = st.builds(lambda r: SPLIT_ALIGN - r, st.integers(1, tokens - 1))
    return {
        "tokens": tokens,
        "prefixes": draw(st.lists(st.one_of(st.integers(0, 90), near_boundary), min_size=bs, max_size=bs)),
        "page_size": draw(st.sampled_from([1, 4])),
        "heads": draw(st.sampled_from([(2, 1), (1, 4), (2, 2)])),  # (num_kv_heads, group)
        "logit_cap": draw(st.sampled_from([0.0, 0.0, 2.0])),
        "max_kv_splits": draw(st.sampled_from([1, 3])),
        "one_launch": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@settings(max_examples=10, deadline=None)
@given(case=tree_cases())
def test_tree_verify_matches_the_ancestor_reference(case: dict) -> None:
    rng = random.Random(case["seed"])
    gen = torch.Generator().manual_seed(case["seed"])
    tokens = case["tokens"]
    lengths = [p + tokens for p in case["prefixes"]]
    num_kv_heads, group = case["heads"]
    trees = [random_parents(tokens, rng) for _ in lengths]
    cache = make_paged_cache(lengths, num_kv_heads, 64, 64, case["page_size"], torch.float32, gen)
    q = (2 * torch.randn(len(lengths) * tokens, num_kv_heads * group, 64, generator=gen)).to(DEVICE)
    splits = torch.tensor([rng.randint(1, case["max_kv_splits"]) for _ in lengths], dtype=torch.int32, device=DEVICE)
    mask = torch.tensor([w for parents in trees for w in bits_of(parents)], dtype=torch.int64, device=DEVICE)
    out = run_tree(cache, q, splits, case["max_kv_splits"], tokens, mask, one_launch=case["one_launch"],
                   logit_cap=case["logit_cap"])
    ref = reference_tree(cache, q, trees, 0.125, case["logit_cap"])
    assert not out.isnan().any()
    assert rel_err(out, ref) <= TOLERANCE[torch.float32], trees


@pytest.mark.parametrize("one_launch", [False, True])
def test_a_chains_bits_give_the_chain_kernels_output(one_launch: bool) -> None:
    """A tree mask holding chains (token t sees draft keys 0..t) changes nothing: bit for bit the output of the
    verify mode without a mask (the chain kernel)."""
    gen = torch.Generator().manual_seed(3)
    tokens, lengths = 5, [5, 70, SPLIT_ALIGN + 2]
    cache = make_paged_cache(lengths, 2, 64, 64, 4, torch.float32, gen)
    q = torch.randn(len(lengths) * tokens, 4, 64, generator=gen).to(DEVICE)
    splits = torch.tensor([1, 2, 3], dtype=torch.int32, device=DEVICE)
    mask = torch.tensor(bits_of(list(range(-1, tokens - 1))) * len(lengths), dtype=torch.int64, device=DEVICE)
    tree = run_tree(cache, q, splits, 3, tokens, mask, one_launch=one_launch)
    chain = run_tree(cache, q, splits, 3, tokens, None, one_launch=one_launch)
    assert torch.equal(tree, chain)


def test_64_tokens_use_bit_63() -> None:
    """Q = 64 (group 1: one program's 64 rows): the last token's word has its sign bit set."""
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    tokens = 64
    parents = list(range(-1, 40)) + [rng.randrange(i) for i in range(41, tokens)]  # a trunk, then random branches
    parents[63] = 62
    lengths = [tokens + 3]
    cache = make_paged_cache(lengths, 1, 64, 64, 1, torch.float32, gen)
    q = torch.randn(tokens, 1, 64, generator=gen).to(DEVICE)
    words = bits_of(parents)
    assert words[63] < 0
    mask = torch.tensor(words, dtype=torch.int64, device=DEVICE)
    out = run_tree(cache, q, torch.ones(1, dtype=torch.int32, device=DEVICE), 1, tokens, mask, one_launch=False)
    assert rel_err(out, reference_tree(cache, q, [parents], 0.125)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("mask, match", [
    (torch.zeros(4, dtype=torch.int32), "tree_mask must be int64"),
    (torch.zeros(3, dtype=torch.int64), r"\(>= 4,\)"),
    (torch.zeros(8, dtype=torch.int64)[::2], "contiguous"),
])
def test_a_bad_tree_mask_is_named(mask: torch.Tensor, match: str) -> None:
    gen = torch.Generator().manual_seed(1)
    cache = make_paged_cache([7, 9], 2, 64, 64, 1, torch.float32, gen)
    q = torch.randn(4, 2, 64, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match=match):
        run_tree(cache, q, torch.ones(2, dtype=torch.int32, device=DEVICE), 2, 2, mask.to(DEVICE), one_launch=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the serving-size case)")
@pytest.mark.parametrize("one_launch", [False, True])
def test_tree_verify_serving_size_gpu(one_launch: bool) -> None:
    """64 requests x random trees of 8 tokens over 500-token prefixes, 32 q / 8 KV heads, head dim 64, bf16, shuffled
    slots, several splits per request: against the float64 ancestor reference."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    tokens, bs = 8, 64
    lengths = [500 + rng.randrange(40) + tokens for _ in range(bs)]
    trees = [random_parents(tokens, rng) for _ in range(bs)]
    cache = make_paged_cache(lengths, 8, 64, 64, 1, torch.bfloat16, gen)
    q = torch.randn(bs * tokens, 32, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    splits = torch.tensor([rng.randint(1, 8) for _ in range(bs)], dtype=torch.int32, device=DEVICE)
    mask = torch.tensor([w for parents in trees for w in bits_of(parents)], dtype=torch.int64, device=DEVICE)
    out = run_tree(cache, q, splits, 8, tokens, mask, one_launch=one_launch)
    assert not out.isnan().any()
    assert rel_err(out, reference_tree(cache, q, trees, 0.125)) <= TOLERANCE[torch.bfloat16]
