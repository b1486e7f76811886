"""The prefix cache on a bare KVCache: a row's computed pages move into the tree and are lent to a later row (its
table points at them), a freed row returns only its own pages, an allocation evicts pages only the tree holds, and
``page_account`` counts every page once and names a page that is held twice or lost."""

from __future__ import annotations

import array

import pytest
import torch

from compile_attn.kv.cache import KVCache
from compile_attn.kv.page_account import PageAccount, PageAccountError, page_account


def make_kv() -> KVCache:
    kv = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, max_batch_size=4, max_context=16, kv_cache_tokens=16,
                 page_size=2, dtype=torch.float32)
    kv.enable_prefix_cache()
    return kv


def test_pages_move_into_the_tree_are_lent_and_evicted() -> None:
    kv = make_kv()
    cache = kv.prefix_cache
    first = kv.alloc_request()
    kv.alloc_extend([first], [7])  # 4 pages, the last holding one token
    cache.insert(first, array.array("q", range(7)))  # its 3 whole pages go into the tree, still its to read
    assert page_account(kv) == PageAccount(free=4, cached_only=0, running=4, total=8)
    second = kv.alloc_request()
    match = cache.match(array.array("q", [0, 1, 2, 3, 9, 9]), 5)
    assert match.pages == kv._pages[first][:2]
    assert cache.attach(second, match, 6) == 4
    assert kv.req_to_token[second, :4].tolist() == kv.req_to_token[first, :4].tolist()  # the same slots
    kv.free_requests([first])  # its own last page is freed; the third cached page is the tree's alone now
    assert page_account(kv) == PageAccount(free=5, cached_only=1, running=2, total=8)
    assert kv.available_pages == 6
    kv.alloc_extend([second], [12])  # 6 more pages: the 5 free ones and the cached-only one, evicted
    assert page_account(kv) == PageAccount(free=0, cached_only=0, running=8, total=8)
    kv.free_requests([second])
    assert page_account(kv) == PageAccount(free=6, cached_only=2, running=0, total=8)
    kv.enable_prefix_cache(False)
    assert kv.allocator.available == 8


def test_the_account_names_a_page_held_twice_or_lost() -> None:
    kv = make_kv()
    row = kv.alloc_request()
    kv.alloc_extend([row], [4])
    kv.prefix_cache.insert(row, array.array("q", [5, 6, 7, 8]))
    page = kv._pages[row][0]
    kv.allocator._free.append(page)  # a borrowed page also on the free list
    with pytest.raises(PageAccountError, match=f"page {page} is free, cached or held 2 times"):
        page_account(kv)
    kv.allocator._free.pop()
    kv.prefix_cache.tree.nodes()[0].pages.pop()  # the tree forgets a page the row still reads
    with pytest.raises(PageAccountError, match="borrows pages"):
        page_account(kv)
