"""build_kv_indptr / build_kv_indices / build_page_indices / store_kv against plain indexing of req_to_token."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.attention.kernels.kernel_reference import DEVICE, make_paged_cache

from compile_attn.attention.kernels import build_kv_indices, build_kv_indptr, build_page_indices, store_kv


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 700), min_size=1, max_size=5),
    page_size=st.sampled_from([1, 16]),
    use_start=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_build_kv_indices_matches_table(lengths, page_size, use_start, seed):
    gen = torch.Generator().manual_seed(seed)
    cache = make_paged_cache(lengths, 1, 4, 4, page_size, torch.float32, gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    kv_start = None
    starts = [0] * len(lengths)
    if use_start:
        starts = [int(torch.randint(0, n + 1, (), generator=gen)) for n in lengths]
        kv_start = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    indptr = torch.full((len(lengths) + 1,), -7, dtype=torch.int32, device=DEVICE)
    build_kv_indptr(seq_lens, indptr, kv_start)
    total = sum(n - s for n, s in zip(lengths, starts))
    assert indptr.tolist() == [0] + torch.tensor([n - s for n, s in zip(lengths, starts)]).cumsum(0).tolist()
    # One sentinel past the end catches writes beyond the last request.
    indices = torch.full((total + 1,), -1, dtype=torch.int32, device=DEVICE)
    build_kv_indices(cache.req_to_token, cache.rows, seq_lens, indptr, indices, kv_start)
    expected = [cache.slots(b, starts[b]) for b in range(len(lengths))]
    expected = torch.cat(expected) if expected else torch.empty(0)
    assert torch.equal(indices[:total].long().cpu(), expected.cpu())
    assert indices[total].item() == -1


def test_build_kv_indices_never_writes_past_its_range():
    gen = torch.Generator().manual_seed(0)
    cache = make_paged_cache([40, 30], 1, 4, 4, 1, torch.float32, gen)
    seq_lens = torch.tensor([40, 30], dtype=torch.int32, device=DEVICE)
    indptr = torch.tensor([0, 10, 20], dtype=torch.int32, device=DEVICE)  # shorter than seq_lens
    indices = torch.full((21,), -1, dtype=torch.int32, device=DEVICE)
    build_kv_indices(cache.req_to_token, cache.rows, seq_lens, indptr, indices)
    assert torch.equal(indices[:10].long().cpu(), cache.slots(0, 0, 10).cpu())
    assert torch.equal(indices[10:20].long().cpu(), cache.slots(1, 0, 10).cpu())
    assert indices[20].item() == -1


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 700), min_size=1, max_size=5),
    page_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_build_page_indices_matches_table(lengths, page_size, seed):
    gen = torch.Generator().manual_seed(seed)
    cache = make_paged_cache(lengths, 1, 4, 4, page_size, torch.float32, gen)
    num_pages = [-(-n // page_size) for n in lengths]
    indptr = torch.tensor([0, *torch.tensor(num_pages).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    total = sum(num_pages)
    indices = torch.full((total + 1,), -1, dtype=torch.int32, device=DEVICE)  # one sentinel past the end
    build_page_indices(cache.req_to_token, cache.rows, indptr, indices, page_size)
    got = indices.long().cpu()
    for b, n in enumerate(lengths):
        pages = got[indptr[b] : indptr[b + 1]]
        slots = cache.slots(b).long().cpu()
        assert torch.equal(pages, slots[::page_size] // page_size)  # page j starts at position j * page_size
        assert torch.equal(slots // page_size, pages.repeat_interleave(page_size)[:n])  # every token on its page
    assert got[total].item() == -1


@pytest.mark.parametrize(
    "dtype,src_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
@pytest.mark.parametrize("head_dim,v_head_dim", [(64, 64), (192, 128), (96, 96)])
def test_store_kv_strided_views(dtype, src_dtype, head_dim, v_head_dim):
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, num_slots = 7, 3, 40
    k_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v_buffer = torch.randn(num_slots, num_kv_heads, v_head_dim, generator=gen).to(dtype).to(DEVICE)
    k_before, v_before = k_buffer.clone(), v_buffer.clone()
    # k/v as slices of a fused projection output; store_kv casts them to the cache dtype.
    width = num_kv_heads * (head_dim + v_head_dim) + 5
    fused = torch.randn(num_tokens, width, generator=gen).to(src_dtype).to(DEVICE)
    k = fused[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = fused[:, num_kv_heads * head_dim : num_kv_heads * (head_dim + v_head_dim)].view(
        num_tokens, num_kv_heads, v_head_dim
    )
    loc = (torch.randperm(num_slots - 1, generator=gen)[:num_tokens] + 1).to(DEVICE)
    store_kv(k_buffer, v_buffer, loc, k, v)
    expected_k, expected_v = k_before.clone(), v_before.clone()
    expected_k[loc] = k.to(dtype)
    expected_v[loc] = v.to(dtype)
    if src_dtype == dtype:
        assert torch.equal(k_buffer, expected_k) and torch.equal(v_buffer, expected_v)
    else:  # a down-cast may round differently (the interpreter truncates): within one bf16 ulp
        torch.testing.assert_close(k_buffer, expected_k, rtol=2**-7, atol=0)
        torch.testing.assert_close(v_buffer, expected_v, rtol=2**-7, atol=0)


def test_store_kv_padding_tokens_hit_scratch_slot_only():
    gen = torch.Generator().manual_seed(2)
    k_buffer = torch.zeros(10, 2, 64, device=DEVICE)
    v_buffer = torch.zeros(10, 2, 64, device=DEVICE)
    k = torch.randn(4, 2, 64, generator=gen).to(DEVICE)
    v = torch.randn(4, 2, 64, generator=gen).to(DEVICE)
    loc = torch.tensor([5, 0, 0, 3], dtype=torch.int32, device=DEVICE)
    store_kv(k_buffer, v_buffer, loc, k, v)
    assert torch.equal(k_buffer[5], k[0]) and torch.equal(k_buffer[3], k[3])
    assert torch.equal(v_buffer[5], v[0]) and torch.equal(v_buffer[3], v[3])
    untouched = [i for i in range(10) if i not in (0, 3, 5)]
    assert k_buffer[untouched].abs().sum() == 0 and v_buffer[untouched].abs().sum() == 0
