"""Split-K paged decode attention and its split heuristic against a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.attention.kernels.kernel_reference import (
    DEVICE, TOLERANCE, make_paged_cache, reference_attention, reference_decode, rel_err, take_new_tokens)

from compile_attn.attention.kernels import (
    SUPPORTED_HEAD_DIMS,
    check_supported,
    compute_num_kv_splits,
    decode_attention_fwd,
    decode_attention_fwd_and_bind,
    decode_semaphores,
)
from compile_attn.ops.triton_launch import is_interpreted
from compile_attn.attention.kernels.decode_attention import _decode_split_kernel


def run_decode(cache, q, starts, num_kv_splits, max_kv_splits, sm_scale, logit_cap=0.0, new_tokens=None,
               one_launch=False):
    """Host-built CSR (independent of build_kv_indices), poisoned scratch and output. ``new_tokens``:
    (k_new, v_new, new_loc) for the fused K/V store. ``one_launch``: the merge inside the split kernel
    (semaphores), whose counters must be zero again afterwards."""
    bs, num_q_heads, _ = q.shape
    v_head_dim = cache.v_buffer.shape[-1]
    slots = [cache.slots(b, starts[b]) for b in range(bs)]
    indptr = torch.tensor([0] + [len(s) for s in slots], device=DEVICE).cumsum(0).to(torch.int32)
    indices = torch.cat([*slots, torch.zeros(1, dtype=torch.long, device=DEVICE)]).to(torch.int32)
    out = torch.full((bs, num_q_heads, v_head_dim), float("nan"), dtype=q.dtype, device=DEVICE)
    logits = torch.full((bs, num_q_heads, max_kv_splits, v_head_dim), float("nan"), device=DEVICE)
    lse = torch.full((bs, num_q_heads, max_kv_splits), float("nan"), device=DEVICE)
    semaphores = decode_semaphores(bs + 1, num_q_heads, DEVICE) if one_launch else None
    decode_attention_fwd(
        q,
        cache.k_buffer,
        cache.v_buffer,
        out,
        indptr,
        indices,
        num_kv_splits,
        max_kv_splits,
        logits,
        lse,
        sm_scale,
        logit_cap,
        **({} if new_tokens is None else dict(zip(("k_new", "v_new", "new_loc"), new_tokens))),
        semaphores=semaphores,
    )
    if one_launch:
        assert not semaphores.any(), "the one-launch merge left a counter set"
    return out


@st.composite
def decode_cases(draw):
    bs = draw(st.integers(1, 4))
    return {
        "lengths": draw(st.lists(st.integers(0, 300), min_size=bs, max_size=bs)),
        "page_size": draw(st.sampled_from([1, 16])),
        # (num_kv_heads, group): GQA ratios 1/4/8 with at most 8 query heads (the interpreter is slow)
        "heads": draw(st.sampled_from([(1, 1), (2, 1), (1, 4), (2, 4), (1, 8)])),
        "dims": draw(st.sampled_from([(64, 64), (128, 128), (96, 96)])),
        "dtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "window": draw(st.sampled_from([-1, -1, 1, 70])),
        "logit_cap": draw(st.sampled_from([0.0, 0.0, 2.0])),
        "max_kv_splits": draw(st.sampled_from([1, 3, 8])),
        "auto_splits": draw(st.booleans()),
        "fused_store": draw(st.booleans()),
        "one_launch": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@settings(max_examples=25, deadline=None)
@given(case=decode_cases())
def test_decode_matches_reference(case):
    gen = torch.Generator().manual_seed(case["seed"])
    lengths, bs = case["lengths"], len(case["lengths"])
    head_dim, v_head_dim = case["dims"]
    num_kv_heads, group = case["heads"]
    num_q_heads = num_kv_heads * group
    max_kv_splits = case["max_kv_splits"]
    cache = make_paged_cache(
        lengths, num_kv_heads, head_dim, v_head_dim, case["page_size"], case["dtype"], gen
    )
    # Sliding-window decode: the query at position n-1 sees the last `window` keys (kv_start).
    window = case["window"]
    starts = [max(0, n - window) if window > 0 else 0 for n in lengths]
    q = (3 * torch.randn(bs, num_q_heads, head_dim, generator=gen)).to(case["dtype"]).to(DEVICE)
    kv_lens = torch.tensor([n - s for n, s in zip(lengths, starts)], dtype=torch.int32, device=DEVICE)
    if case["auto_splits"]:
        num_kv_splits = compute_num_kv_splits(
            kv_lens, 2, max_kv_splits, num_kv_heads=num_kv_heads, split_size=64
        )
    else:  # includes out-of-range counts (0, > max) that the kernels clamp
        num_kv_splits = torch.randint(0, max_kv_splits + 3, (bs,), generator=gen).int().to(DEVICE)
    sm_scale = 1 / math.sqrt(head_dim)
    new_tokens = original = None
    if case["fused_store"]:
        *new_tokens, original = take_new_tokens(cache, bs, gen)
    out = run_decode(cache, q, starts, num_kv_splits, max_kv_splits, sm_scale, case["logit_cap"], new_tokens,
                     one_launch=case["one_launch"])
    if original is not None:  # the fused store put every new token back, bit for bit
        assert torch.equal(cache.k_buffer, original[0]) and torch.equal(cache.v_buffer, original[1])
    ref = reference_decode(cache, q, starts, sm_scale, case["logit_cap"])
    assert not out.isnan().any()
    assert rel_err(out, ref) <= TOLERANCE[case["dtype"]]


def test_decode_fused_store_without_new_loc_attends_but_does_not_store():
    gen = torch.Generator().manual_seed(5)
    cache = make_paged_cache([1, 40, 130], 2, 64, 64, 16, torch.bfloat16, gen)
    q = torch.randn(3, 8, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    k_new, v_new, new_loc, original = take_new_tokens(cache, 3, gen)
    poisoned = cache.k_buffer.clone()
    out = run_decode(cache, q, [0, 0, 0], torch.tensor([1, 2, 3], dtype=torch.int32, device=DEVICE), 3, 0.125,
                     new_tokens=(k_new, v_new, None))
    assert torch.equal(cache.k_buffer.isnan(), poisoned.isnan())  # nothing was written
    cache.k_buffer.copy_(original[0])
    cache.v_buffer.copy_(original[1])
    assert rel_err(out, reference_decode(cache, q, [0, 0, 0], 0.125)) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(new_loc=True), "needs both k_new and v_new"),
        (dict(k_new=(2, 2, 64), v_new=(4, 2, 64), new_loc=True), "k_new has shape"),
        (dict(k_new=(3, 2, 32), v_new=(3, 2, 64)), "k_new has shape"),
        (dict(k_new=(4, 2, 64), v_new=(4, 1, 64)), "v_new has shape"),
    ],
)
def test_decode_fused_store_names_bad_new_tokens(kwargs, match):
    gen = torch.Generator().manual_seed(6)
    cache = make_paged_cache([3, 5, 7, 9], 2, 64, 64, 1, torch.float32, gen)
    q = torch.randn(4, 4, 64, generator=gen).to(DEVICE)
    k_new = torch.zeros(*kwargs["k_new"], device=DEVICE) if "k_new" in kwargs else None
    v_new = torch.zeros(*kwargs["v_new"], device=DEVICE) if "v_new" in kwargs else None
    new_loc = torch.zeros(4, dtype=torch.int64, device=DEVICE) if kwargs.get("new_loc") else None
    with pytest.raises(ValueError, match=match):
        run_decode(cache, q, [0] * 4, torch.ones(4, dtype=torch.int32, device=DEVICE), 2, 0.125,
                   new_tokens=(k_new, v_new, new_loc))


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_every_head_dim(head_dim, dtype):
    gen = torch.Generator().manual_seed(head_dim)
    lengths = [1, 100]
    v_head_dim = 128 if head_dim == 192 else head_dim  # 192/128: the DeepSeek-style K/V split
    cache = make_paged_cache(lengths, 2, head_dim, v_head_dim, 16, dtype, gen)
    q = torch.randn(2, 8, head_dim, generator=gen).to(dtype).to(DEVICE)
    splits = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    out = run_decode(cache, q, [0, 0], splits, 2, head_dim**-0.5)
    ref = reference_decode(cache, q, [0, 0], head_dim**-0.5)
    assert rel_err(out, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("one_launch", [False, True])
def test_decode_empty_and_padded_requests(one_launch):
    """seq_len 0 gives zeros; a padded request (seq_len 1 at scratch slot 0) gives finite values."""
    gen = torch.Generator().manual_seed(3)
    cache = make_paged_cache([0, 1, 50], 2, 64, 64, 1, torch.bfloat16, gen)
    cache.req_to_token[int(cache.rows[1]), 0] = 0  # the padded request reads scratch slot 0
    q = torch.randn(3, 8, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    splits = torch.tensor([4, 4, 4], dtype=torch.int32, device=DEVICE)
    out = run_decode(cache, q, [0, 0, 0], splits, 4, 0.125, one_launch=one_launch)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert out.isfinite().all()
    ref = reference_decode(cache, q, [0, 0, 0], 0.125)
    assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("one_launch", [False, True])
def test_decode_split_count_does_not_change_result(one_launch):
    """1..18 non-empty splits (more than one merge chunk of 16) all give the reference result."""
    gen = torch.Generator().manual_seed(4)
    cache = make_paged_cache([1100], 1, 64, 64, 1, torch.float32, gen)
    q = torch.randn(1, 4, 64, generator=gen).to(DEVICE)
    # The last split (in the second merge chunk) gets the largest scores, so the merge must rescale.
    tail = cache.slots(0, 1100 - 60)
    cache.k_buffer[tail] = q[0, 0] * 0.5
    ref = reference_decode(cache, q, [0], 0.125)
    for n in (1, 2, 5, 32):
        out = run_decode(cache, q, [0], torch.tensor([n], dtype=torch.int32, device=DEVICE), 32, 0.125,
                         one_launch=one_launch)
        assert rel_err(out, ref) <= TOLERANCE[torch.float32]


def test_decode_one_launch_matches_two_launches_and_reruns():
    """The in-kernel merge gives the two-launch result (to fp32 rounding), and a second launch on the same
    counters (as a graph replay does) gives it again."""
    gen = torch.Generator().manual_seed(8)
    lengths = [0, 1, 63, 64, 65, 200, 700]
    cache = make_paged_cache(lengths, 2, 64, 64, 1, torch.float32, gen)
    q = torch.randn(len(lengths), 8, 64, generator=gen).to(DEVICE)
    splits = torch.tensor([3, 1, 2, 2, 2, 4, 8], dtype=torch.int32, device=DEVICE)
    two = run_decode(cache, q, [0] * len(lengths), splits, 8, 0.125)
    one = run_decode(cache, q, [0] * len(lengths), splits, 8, 0.125, one_launch=True)
    torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-6)
    assert rel_err(one, reference_decode(cache, q, [0] * len(lengths), 0.125)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("one_launch", [False, True])
def test_bound_decode_repeats_with_what_the_buffers_hold_then(one_launch):
    """``decode_attention_fwd_and_bind`` decodes like ``decode_attention_fwd``; its bound repeat (compiled kernels
    only: interpreted ones get None) reads the same buffers' contents at the time it runs: new queries, a new
    token's K/V stored to another slot, other split counts, a request's KV range moved to other slots."""
    gen = torch.Generator().manual_seed(12)
    lengths = [0, 9, 130, 300]
    cache = make_paged_cache(lengths, 2, 64, 64, 1, torch.bfloat16, gen)
    bs, hq = len(lengths), 8
    q = torch.randn(bs, hq, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    k_new = torch.randn(bs, 2, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    v_new = torch.randn(bs, 2, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    slots = [cache.slots(b) for b in range(bs)]
    indptr = torch.tensor([0] + [len(s) for s in slots], device=DEVICE).cumsum(0).to(torch.int32)
    indices = torch.cat([*slots, torch.zeros(1, dtype=torch.long, device=DEVICE)]).to(torch.int32)
    new_loc = torch.stack([s[-1] if len(s) else torch.tensor(0, device=DEVICE) for s in slots]).to(torch.int64)
    splits = torch.tensor([1, 2, 3, 4], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    logits = torch.empty(bs, hq, 4, 64, device=DEVICE)
    lse = torch.empty(bs, hq, 4, device=DEVICE)
    semaphores = decode_semaphores(bs, hq, DEVICE) if one_launch else None

    def expected() -> torch.Tensor:
        k_saved, v_saved = cache.k_buffer.clone(), cache.v_buffer.clone()
        for b in range(1, bs):  # the new token is each request's last position (request 0 has no KV)
            cache.k_buffer[new_loc[b]], cache.v_buffer[new_loc[b]] = k_new[b], v_new[b]
        ref = torch.cat([
            reference_attention(q[b:b + 1], cache.k_buffer[slots[b]], cache.v_buffer[slots[b]],
                                torch.ones(1, len(slots[b]), dtype=torch.bool, device=DEVICE), 0.125)
            for b in range(bs)
        ])
        cache.k_buffer.copy_(k_saved)
        cache.v_buffer.copy_(v_saved)
        return ref

    ref = expected()
    again = decode_attention_fwd_and_bind(q, cache.k_buffer, cache.v_buffer, out, indptr, indices, splits, 4, logits,
                                          lse, 0.125, k_new=k_new, v_new=v_new, new_loc=new_loc,
                                          semaphores=semaphores)
    assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(cache.k_buffer[new_loc[1:]], k_new[1:])
    if is_interpreted(_decode_split_kernel):
        assert again is None
        return
    assert again is not None
    # same buffers, new contents: request 3 now reads request 2's slots (but the one request 2 stores to) and its
    # own last one
    q.copy_(torch.randn(bs, hq, 64, generator=gen).to(torch.bfloat16))
    k_new.copy_(torch.randn(bs, 2, 64, generator=gen).to(torch.bfloat16))
    splits.copy_(torch.tensor([4, 1, 4, 2], dtype=torch.int32))
    moved = torch.cat([slots[2][:-1], slots[3][-1:]]).to(torch.int32)
    indices[int(indptr[3]):int(indptr[3]) + len(moved)] = moved
    indptr[4] = indptr[3] + len(moved)
    slots[3] = moved.long()
    new_loc[3] = moved[-1]
    out.fill_(float("nan"))
    cache.k_buffer[new_loc[1:]] = 0  # the bound launch must store the new K again
    ref = expected()
    assert again() is True
    assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(cache.k_buffer[new_loc[1:]], k_new[1:])
    if one_launch:
        assert not semaphores.any()


@pytest.mark.parametrize(
    "semaphores,match",
    [
        (lambda: torch.zeros(2, 8, dtype=torch.int32, device=DEVICE), r"\(>= 3, >= 8\)"),
        (lambda: torch.zeros(3, 4, dtype=torch.int32, device=DEVICE), "int32 of shape"),
        (lambda: torch.zeros(3, 8, dtype=torch.int64, device=DEVICE), "torch.int64"),
        (lambda: torch.zeros(8, 3, dtype=torch.int32, device=DEVICE).t(), "row-contiguous"),
    ],
)
def test_decode_names_bad_semaphores(semaphores, match):
    gen = torch.Generator().manual_seed(9)
    cache = make_paged_cache([3, 5, 7], 2, 64, 64, 1, torch.float32, gen)
    q = torch.randn(3, 8, 64, generator=gen).to(DEVICE)
    out = torch.empty_like(q)
    logits = torch.empty(3, 8, 2, 64, device=DEVICE)
    lse = torch.empty(3, 8, 2, device=DEVICE)
    indptr = torch.tensor([0, 3, 8, 15], dtype=torch.int32, device=DEVICE)
    indices = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        decode_attention_fwd(q, cache.k_buffer, cache.v_buffer, out, indptr, indices,
                             torch.ones(3, dtype=torch.int32, device=DEVICE), 2, logits, lse, 0.125,
                             semaphores=semaphores())


def test_num_kv_splits_deterministic_depends_only_on_own_length():
    lens = torch.tensor([0, 1, 64, 65, 1000, 100000], device=DEVICE)
    splits = compute_num_kv_splits(lens, 132, 16, deterministic=True, split_size=64)
    assert splits.dtype == torch.int32 and splits.device == lens.device
    assert splits.tolist() == [1, 1, 1, 2, 16, 16]
    alone = compute_num_kv_splits(lens[4:5], 132, 16, deterministic=True, split_size=64)
    assert alone.item() == splits[4].item()


def test_num_kv_splits_heuristic_follows_load():
    one_long = compute_num_kv_splits(torch.tensor([8192], device=DEVICE), 132, 32, num_kv_heads=8)
    assert one_long.item() > 1  # a lone long request is spread over the SMs
    many = compute_num_kv_splits(torch.full((512,), 4096, device=DEVICE), 132, 32, num_kv_heads=8)
    assert many.eq(1).all()  # enough requests to fill the GPU without splitting
    mixed = compute_num_kv_splits(torch.tensor([10, 5000, 0], device=DEVICE), 132, 16, num_kv_heads=8)
    assert mixed[0] <= mixed[1] and mixed.min() >= 1 and mixed.max() <= 16
    out = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    assert (
        compute_num_kv_splits(torch.tensor([10, 5000, 0], device=DEVICE), 132, 16, num_kv_heads=8, out=out)
        is out
    )
    assert torch.equal(out, mixed)


@pytest.mark.parametrize(
    "args,bad",
    [
        ((80, 80, torch.bfloat16), "head_dim 80"),
        ((128, 48, torch.float16), "v_head_dim 48"),
        ((128, 128, torch.float64), "dtype torch.float64"),
    ],
)
def test_check_supported_names_bad_value(args, bad):
    with pytest.raises(ValueError, match=bad) as info:
        check_supported(*args)
    assert "torch_native" in str(info.value) and "supported" in str(info.value)
    check_supported(128, 128, torch.bfloat16)


@pytest.mark.parametrize("value,off", [("0", True), ("off", True), (" False ", True), ("1", False), ("", False)])
def test_pdl_switch_reads_the_environment(monkeypatch, value, off):
    from compile_attn.env import PDL_ENV, pdl_turned_off

    monkeypatch.setenv(PDL_ENV, value)
    assert pdl_turned_off() is off
    monkeypatch.delenv(PDL_ENV)
    assert pdl_turned_off() is False
