"""Extend attention (cached prefix + new tokens) against a float64 reference with explicit masks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.attention.kernels.kernel_reference import DEVICE, TOLERANCE, make_paged_cache, reference_attention, rel_err

from compile_attn.attention.kernels import SUPPORTED_HEAD_DIMS, extend_attention_fwd


def make_extend_batch(prefix, extend, num_kv_heads, num_q_heads, head_dim, v_head_dim, page_size, dtype, gen):
    cache = make_paged_cache(
        [p + e for p, e in zip(prefix, extend)], num_kv_heads, head_dim, v_head_dim, page_size, dtype, gen
    )
    num_tokens = sum(extend)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(num_tokens, num_kv_heads, v_head_dim, generator=gen).to(dtype).to(DEVICE)
    return cache, q, k, v


def run_extend(cache, q, k, v, prefix, extend, sm_scale, **kwargs):
    qo_indptr = torch.tensor([0, *extend], device=DEVICE).cumsum(0).to(torch.int32)
    kv_indptr = torch.tensor([0, *prefix], device=DEVICE).cumsum(0).to(torch.int32)
    slots = [cache.slots(b, 0, p) for b, p in enumerate(prefix)]
    kv_indices = torch.cat([*slots, torch.zeros(1, dtype=torch.long, device=DEVICE)]).to(torch.int32)
    out = torch.full((q.shape[0], q.shape[1], v.shape[-1]), float("nan"), dtype=q.dtype, device=DEVICE)
    extend_attention_fwd(
        q,
        k,
        v,
        out,
        cache.k_buffer,
        cache.v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        max(extend),
        sm_scale,
        **kwargs,
    )
    return out


def reference_extend(
    cache, q, k, v, prefix, extend, sm_scale, is_causal=True, sliding_window=-1, logit_cap=0.0, masks=None
):
    outs, q_lo = [], 0
    for b, (p, e) in enumerate(zip(prefix, extend)):
        slots = cache.slots(b, 0, p)
        keys = torch.cat([cache.k_buffer[slots], k[q_lo : q_lo + e]])
        values = torch.cat([cache.v_buffer[slots], v[q_lo : q_lo + e]])
        q_pos = torch.arange(p, p + e, device=DEVICE)[:, None]
        k_pos = torch.arange(p + e, device=DEVICE)[None, :]
        if masks is not None:
            allowed = masks[b]
        elif is_causal:
            allowed = k_pos <= q_pos
        else:
            allowed = torch.ones(e, p + e, dtype=torch.bool, device=DEVICE)
        if sliding_window > 0:
            allowed = allowed & (k_pos > q_pos - sliding_window)
        outs.append(reference_attention(q[q_lo : q_lo + e], keys, values, allowed, sm_scale, logit_cap))
        q_lo += e
    return torch.cat(outs)


@st.composite
def extend_cases(draw):
    bs = draw(st.integers(1, 3))
    return {
        "prefix": draw(st.lists(st.integers(0, 150), min_size=bs, max_size=bs)),
        "extend": draw(st.lists(st.integers(0, 90), min_size=bs, max_size=bs).filter(lambda x: max(x) > 0)),
        "page_size": draw(st.sampled_from([1, 16])),
        # (num_kv_heads, group): GQA ratios 1/4/8 with at most 8 query heads (the interpreter is slow)
        "heads": draw(st.sampled_from([(1, 1), (2, 1), (1, 4), (2, 4), (1, 8)])),
        "dims": draw(st.sampled_from([(64, 64), (128, 128)])),
        "dtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "sliding_window": draw(st.sampled_from([-1, -1, 1, 20, 100])),
        "logit_cap": draw(st.sampled_from([0.0, 0.0, 2.0])),
        "is_causal": draw(st.sampled_from([True, True, False])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


# Interpreted on the CPU each example costs its run; compiled on a GPU each new constexpr combination (page size,
# group, head dim, dtype, window, cap, causal) costs a ~7 s Triton compile on a fresh cache (20 examples took 156 s
# on the H100 machine), and tests/attention/kernels/test_kernels_gpu.py covers the compiled kernel at long prefixes.
EXAMPLES = 20 if DEVICE == "cpu" else 8


@settings(max_examples=EXAMPLES, deadline=None)
@given(case=extend_cases())
def test_extend_matches_reference(case):
    gen = torch.Generator().manual_seed(case["seed"])
    prefix, extend = case["prefix"], case["extend"]
    head_dim, v_head_dim = case["dims"]
    num_kv_heads, group = case["heads"]
    num_q_heads = num_kv_heads * group
    cache, q, k, v = make_extend_batch(
        prefix, extend, num_kv_heads, num_q_heads, head_dim, v_head_dim, case["page_size"], case["dtype"], gen
    )
    q = q * 3  # scores of a few units, so the soft cap matters
    opts = {
        "is_causal": case["is_causal"],
        "sliding_window": case["sliding_window"],
        "logit_cap": case["logit_cap"],
    }
    sm_scale = 1 / math.sqrt(head_dim)
    out = run_extend(cache, q, k, v, prefix, extend, sm_scale, **opts)
    ref = reference_extend(cache, q, k, v, prefix, extend, sm_scale, **opts)
    assert not out.isnan().any()
    assert rel_err(out, ref) <= TOLERANCE[case["dtype"]]


@settings(max_examples=20, deadline=None)
@given(
    prefix=st.lists(st.integers(0, 80), min_size=1, max_size=3),
    seed=st.integers(0, 2**31 - 1),
    sliding_window=st.sampled_from([-1, 30]),
    explicit_indptr=st.booleans(),
    density=st.sampled_from([0.1, 0.6, 0.95]),
)
def test_extend_custom_mask(prefix, seed, sliding_window, explicit_indptr, density):
    """A tree-verification style mask replaces the causal rule (rows may even be fully masked)."""
    gen = torch.Generator().manual_seed(seed)
    extend = [int(torch.randint(1, 20, (), generator=gen)) for _ in prefix]
    cache, q, k, v = make_extend_batch(prefix, extend, 2, 4, 64, 64, 16, torch.float32, gen)
    masks = [(torch.rand(e, p + e, generator=gen) < density).to(DEVICE) for p, e in zip(prefix, extend)]
    flat = torch.cat([m.flatten() for m in masks])
    sizes = torch.tensor([0] + [m.numel() for m in masks]).cumsum(0).to(DEVICE)
    opts = {
        "sliding_window": sliding_window,
        "custom_mask": flat,
        "mask_indptr": sizes if explicit_indptr else None,
    }
    out = run_extend(cache, q, k, v, prefix, extend, 0.125, **opts)
    ref = reference_extend(cache, q, k, v, prefix, extend, 0.125, sliding_window=sliding_window, masks=masks)
    assert not out.isnan().any()
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_extend_every_head_dim(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    prefix, extend = [40, 0], [5, 70]
    v_head_dim = 128 if head_dim == 192 else head_dim
    cache, q, k, v = make_extend_batch(prefix, extend, 1, 4, head_dim, v_head_dim, 1, torch.bfloat16, gen)
    out = run_extend(cache, q, k, v, prefix, extend, head_dim**-0.5)
    ref = reference_extend(cache, q, k, v, prefix, extend, head_dim**-0.5)
    assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]


@settings(max_examples=8 if DEVICE == "cpu" else 20, deadline=None)
@given(
    prefix=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    seed=st.integers(0, 2**31 - 1),
    sliding_window=st.sampled_from([-1, 1, 6, 25]),
    logit_cap=st.sampled_from([0.0, 2.0]),
)
def test_extend_mask_over_new_keys_with_positions(prefix, seed, sliding_window, logit_cap):
    """A draft-tree style call: the mask covers the new keys only ([n, n] per request, every cached key visible) and
    the new tokens carry their own positions for the window (not prefix + index)."""
    gen = torch.Generator().manual_seed(seed)
    extend = [int(torch.randint(1, 20, (), generator=gen)) for _ in prefix]
    cache, q, k, v = make_extend_batch(prefix, extend, 2, 4, 64, 64, 4, torch.float32, gen)
    q = q * 3
    masks = [torch.rand(e, e, generator=gen) < 0.5 for e in extend]
    for m in masks:
        m.fill_diagonal_(True)
    # positions from the prefix length up, not increasing with the token index (as a tree's prefix + depth)
    positions = [p + torch.randint(0, e, (e,), generator=gen) for p, e in zip(prefix, extend)]
    sizes = torch.tensor([0] + [e * e for e in extend]).cumsum(0).to(DEVICE)
    out = run_extend(cache, q, k, v, prefix, extend, 0.125, sliding_window=sliding_window, logit_cap=logit_cap,
                     custom_mask=torch.cat([m.flatten() for m in masks]).to(DEVICE), mask_indptr=sizes,
                     mask_new_keys_only=True, positions=torch.cat(positions).to(torch.int32).to(DEVICE))
    full = []  # the same rule written out over [cached | new] keys
    for p, e, m, pos in zip(prefix, extend, masks, positions):
        k_pos = torch.cat([torch.arange(p), pos])
        allowed = torch.cat([torch.ones(e, p, dtype=torch.bool), m], dim=1)
        if sliding_window > 0:
            allowed &= k_pos[None, :] > pos[:, None] - sliding_window
        full.append(allowed.to(DEVICE))
    ref = reference_extend(cache, q, k, v, prefix, extend, 0.125, logit_cap=logit_cap, masks=full)
    assert not out.isnan().any()
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]
