"""KV cache: page layout, all-or-nothing allocation, exhaustion leaves the cache unchanged, the page table."""

from __future__ import annotations

import array

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from compile_attn import InvalidBatchError, KVCache, KVCacheExhaustedError
from compile_attn.batch import PAD_SLOT
from compile_attn.attention.fa3.backend import build_page_table


def _cache(page_size: int = 1, kv_cache_tokens: int = 64, max_batch_size: int = 4, max_context: int = 48) -> KVCache:
    return KVCache(num_layers=2, num_kv_heads=2, head_dim=4, max_batch_size=max_batch_size, max_context=max_context,
                   kv_cache_tokens=kv_cache_tokens, page_size=page_size, dtype=torch.float32)


def _state(kv: KVCache) -> tuple:
    return (kv.req_to_token.clone(), kv.allocator.available, list(kv.allocator._free), dict(kv._lens),
            {r: list(p) for r, p in kv._pages.items()})


def _assert_same_state(a: tuple, b: tuple) -> None:
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_slots_follow_pages_and_never_use_the_scratch_page(page_size: int) -> None:
    kv = _cache(page_size, kv_cache_tokens=128)
    rows = [kv.alloc_request(), kv.alloc_request()]
    first = kv.alloc_extend(rows, [5, 3])
    second = kv.alloc_extend(rows, [page_size + 2, 1])
    for row, total in zip(rows, [5 + page_size + 2, 4]):
        slots = kv.req_to_token[row, :total].tolist()
        assert len(set(slots)) == total
        for pos, slot in enumerate(slots):
            assert slot // page_size != 0, "scratch page handed out"
            assert slot % page_size == pos % page_size
            assert slot // page_size == slots[pos - pos % page_size] // page_size  # same page within a page
    assert torch.equal(torch.cat([first[:5], second[: page_size + 2]]), kv.req_to_token[rows[0], : 5 + page_size + 2].long())


@pytest.mark.parametrize("page_size", [1, 16])
def test_exhaustion_is_clear_and_leaves_the_cache_unchanged(page_size: int) -> None:
    kv = _cache(page_size, kv_cache_tokens=32)
    rows = [kv.alloc_request(), kv.alloc_request()]
    kv.alloc_extend(rows, [10, 3])
    before = _state(kv)
    with pytest.raises(KVCacheExhaustedError, match="nothing was allocated"):
        kv.alloc_extend(rows, [8, 30])  # the first request fits alone, the batch does not
    _assert_same_state(before, _state(kv))
    kv.free_request(rows[1])
    assert kv.req_to_token[rows[1]].eq(PAD_SLOT).all()
    kv.alloc_extend([rows[0]], [8])  # the freed pages are usable again


def test_request_table_exhaustion_and_bad_frees() -> None:
    kv = _cache(max_batch_size=2)
    rows = [kv.alloc_request(), kv.alloc_request()]
    with pytest.raises(KVCacheExhaustedError, match="request table full: asked for 1 rows, 0 free of 2"):
        kv.alloc_request()
    kv.free_request(rows[0])
    with pytest.raises(ValueError, match="not allocated"):
        kv.free_request(rows[0])
    with pytest.raises(InvalidBatchError, match="past max_context 48"):
        kv.alloc_extend([rows[1]], [49])
    with pytest.raises(InvalidBatchError, match="appears twice"):
        kv.alloc_extend([rows[1], rows[1]], [1, 1])


@pytest.mark.parametrize("page_size", [1, 4])
def test_freeing_requests_together_equals_one_by_one(page_size: int) -> None:
    """free_requests (one allocator call, one device op for the rows) leaves the same cache as free_request per
    row: pages back on the free list, rows reset to the scratch slot and reusable; bad calls change nothing."""
    caches = [_cache(page_size, kv_cache_tokens=128, max_batch_size=4) for _ in range(2)]
    for kv in caches:
        rows = [kv.alloc_request() for _ in range(4)]
        kv.alloc_extend(rows, [5, 9, 3, 7])
    together, one_by_one = caches
    before = _state(together)
    with pytest.raises(ValueError, match="appears twice"):
        together.free_requests([rows[0], rows[2], rows[0]])
    with pytest.raises(ValueError, match="not allocated"):
        together.free_requests([rows[1], 99])
    _assert_same_state(before, _state(together))
    together.free_requests([rows[2], rows[0], rows[3]])
    for row in (rows[2], rows[0], rows[3]):
        one_by_one.free_request(row)
    _assert_same_state(_state(together), _state(one_by_one))
    assert together.req_to_token[[rows[0], rows[2], rows[3]]].eq(PAD_SLOT).all()
    assert together.req_to_token[rows[1], :9].ne(PAD_SLOT).all()  # the live request is untouched
    again = [together.alloc_request() for _ in range(3)]
    together.alloc_extend(again, [2, 2, 2])


@given(
    page_size=st.sampled_from([1, 2, 16]),
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    seed=st.integers(0, 1000),
)
def test_page_table_agrees_with_req_to_token(page_size: int, lens: list[int], seed: int) -> None:
    """FA3's page table read from ``req_to_token`` lists each request's pages as the cache handed them out."""
    kv = _cache(page_size, kv_cache_tokens=256)
    perm = torch.randperm(kv.allocator.available, generator=torch.Generator().manual_seed(seed)).tolist()
    kv.allocator._free = array.array("q", [kv.allocator._free[i] for i in perm])
    rows = [kv.alloc_request() for _ in lens]
    kv.alloc_extend(rows, lens)
    expected_pages = [kv._pages[r].tolist() for r in rows]
    width = max(len(ps) for ps in expected_pages)
    table = build_page_table(kv.req_to_token, torch.tensor(rows), width, page_size)
    for b, ps in enumerate(expected_pages):
        assert table[b, : len(ps)].tolist() == ps
        assert table[b, len(ps):].tolist() == [0] * (width - len(ps))


@pytest.mark.parametrize("page_size", [1, 4, 16])
@given(chunks=st.lists(st.integers(0, 40), min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_one_large_extend_equals_the_same_tokens_in_small_extends(page_size: int, chunks: list[int], seed: int) -> None:
    """Bulk allocation (a prefill) lays out slots exactly as token-by-token allocation does."""
    total = sum(chunks)
    kv_bulk, kv_steps = (_cache(page_size, kv_cache_tokens=512, max_context=256) for _ in range(2))
    for kv in (kv_bulk, kv_steps):  # the same shuffled free list in both caches
        perm = torch.randperm(len(kv.allocator._free), generator=torch.Generator().manual_seed(seed)).tolist()
        kv.allocator._free = array.array("q", [kv.allocator._free[i] for i in perm])
    other_b, row_b = kv_bulk.alloc_request(), kv_bulk.alloc_request()
    other_s, row_s = kv_steps.alloc_request(), kv_steps.alloc_request()
    kv_bulk.alloc_extend([other_b], [3])
    kv_steps.alloc_extend([other_s], [3])
    bulk = kv_bulk.alloc_extend([row_b], [total]).tolist()
    steps = [s for n in chunks for _ in range(n) for s in kv_steps.alloc_extend([row_s], [1]).tolist()]
    assert bulk == steps
    assert torch.equal(kv_bulk.req_to_token, kv_steps.req_to_token)
    # every slot distinct, off the scratch page, and freed pages come back whole
    assert len(set(bulk)) == total and all(s // page_size != 0 for s in bulk)
    available = kv_bulk.allocator.available
    kv_bulk.free_request(row_b)
    assert kv_bulk.allocator.available == available + -(-total // page_size)


def test_freeing_a_page_twice_in_one_call_is_refused() -> None:
    kv = _cache(page_size=1)
    pages = kv.allocator.alloc(3)
    with pytest.raises(ValueError, match="not an allocated page"):
        kv.allocator.free([pages[0], pages[1], pages[0]])
    assert kv.allocator.available == 64 - 3  # nothing was freed
    kv.allocator.free(pages)
    with pytest.raises(ValueError, match="not an allocated page"):
        kv.allocator.free([pages[0]])


@pytest.mark.parametrize("page_size", [1, 4, 16])
@given(prefix=st.lists(st.integers(0, 40), min_size=1, max_size=8), steps=st.integers(1, 20),
       seed=st.integers(0, 2**16))
def test_decode_allocation_equals_the_general_path(page_size: int, prefix: list[int], steps: int, seed: int) -> None:
    """One token for every request (the decode path, in comprehensions) lays out slots and bookkeeping exactly as
    the general path does (forced here by a zero-token request in the same call)."""
    fast, general = (_cache(page_size, kv_cache_tokens=1024, max_batch_size=10, max_context=64) for _ in range(2))
    for kv in (fast, general):
        perm = torch.randperm(len(kv.allocator._free), generator=torch.Generator().manual_seed(seed)).tolist()
        kv.allocator._free = array.array("q", [kv.allocator._free[i] for i in perm])
        rows = [kv.alloc_request() for _ in prefix]
        kv.alloc_extend(rows, prefix)
    idle = general.alloc_request()
    fast.alloc_request()  # the same rows taken in both
    for _ in range(steps):
        a = fast.alloc_extend(rows, [1] * len(rows))
        b = general.alloc_extend([*rows, idle], [1] * len(rows) + [0])
        assert a.tolist() == b.tolist()
    _assert_same_state(_state(fast), _state(general))


@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_allocation_errors_leave_the_cache_unchanged(page_size: int) -> None:
    kv = _cache(page_size, kv_cache_tokens=16, max_context=12)
    rows = [kv.alloc_request(), kv.alloc_request()]
    kv.alloc_extend(rows, [11, 3])
    before = _state(kv)
    for bad_rows, error, match in (([rows[0], rows[1]], None, None), ([rows[1], rows[1]], InvalidBatchError, "twice"),
                                   ([rows[1], 3], InvalidBatchError, "not allocated")):
        if error is None:
            kv.alloc_extend(bad_rows, [1, 1])  # row 0 reaches max_context exactly
            with pytest.raises(InvalidBatchError, match="past max_context 12"):
                kv.alloc_extend(bad_rows, [1, 1])
            before = _state(kv)
            continue
        with pytest.raises(error, match=match):
            kv.alloc_extend(bad_rows, [1, 1])
        _assert_same_state(before, _state(kv))
    kv.free_request(rows[0])
    others = [kv.alloc_request() for _ in range(2)]
    before = _state(kv)
    with pytest.raises(KVCacheExhaustedError, match="nothing was allocated"):
        while True:  # decode until the pool is full
            kv.alloc_extend([rows[1], *others], [1, 1, 1])
            before = _state(kv)
    _assert_same_state(before, _state(kv))


def test_former_keyword_names_still_build_the_same_cache() -> None:
    """``max_requests`` / ``num_tokens`` (the names before ``max_batch_size`` / ``kv_cache_tokens``) warn and build
    a cache of the same rows and pages; a keyword that is neither is refused."""
    with pytest.warns(DeprecationWarning) as caught:
        old = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, max_requests=3, max_context=8, num_tokens=20,
                      page_size=4, dtype=torch.float32)
    assert sorted(str(w.message).split("(")[1].split("=")[0] for w in caught) == ["max_requests", "num_tokens"]
    assert (old.req_to_token_pool.num_rows, old.allocator.num_pages) == (4, 5)
    with pytest.raises(TypeError, match="max_reqs"):
        KVCache(num_layers=1, num_kv_heads=1, head_dim=4, max_reqs=3, max_context=8, kv_cache_tokens=20)


@pytest.mark.parametrize("page_size", [1, 4])
def test_truncate_gives_back_the_pages_past_the_length_and_is_a_no_op_at_it(page_size: int) -> None:
    """Cutting a row back to an earlier length equals never having allocated the rest; cutting it to the length
    it holds changes nothing, and a batch issued before stays trusted."""
    kv, fresh = _cache(page_size, kv_cache_tokens=64), _cache(page_size, kv_cache_tokens=64)
    (row,), (fresh_row,) = [kv.alloc_request()], [fresh.alloc_request()]
    kv.alloc_extend([row], [5])
    fresh.alloc_extend([fresh_row], [5])
    kv.alloc_extend([row], [7])
    kv.truncate(row, 5)
    (table, free, lens, pages), (fresh_table, fresh_free, fresh_lens, fresh_pages) = (
        (c.req_to_token, sorted(c.allocator._free), c._lens, c._pages) for c in (kv, fresh))
    assert torch.equal(table, fresh_table) and (free, lens, pages) == (fresh_free, fresh_lens, fresh_pages)
    out = kv.alloc_extend([row], [3])
    before, generation = _state(kv), kv.generation
    kv.truncate(row, 8)
    _assert_same_state(_state(kv), before)
    assert kv.generation == generation and kv.issued(out, [row], [5], [3])
    with pytest.raises(ValueError, match="cannot truncate request row .* to 9 tokens: it holds 8"):
        kv.truncate(row, 9)
