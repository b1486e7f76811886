"""The radix tree of the prefix cache against a brute-force model: every match is the longest prefix, in whole
pages, shared with a sequence inserted before (and its pages are the ones inserted for it first); pins keep nodes
from eviction; eviction drops least recently used unpinned leaves and its counters add up."""

from __future__ import annotations

import array

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_attn.kv.radix_tree import RadixTree


def lcp_pages(a: list[int], b: list[int], page_size: int) -> int:
    """Whole pages at the start of ``a`` and ``b`` whose tokens all agree (brute force)."""
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k // page_size


class Reference:
    """What the tree must answer, kept as a list of (tokens, pages) in insertion order."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.seqs: list[tuple[list[int], list[int]]] = []

    def match(self, tokens: list[int]) -> list[int]:
        """The pages of the longest cached prefix: page j comes from the first sequence that holds page j."""
        best = max((lcp_pages(tokens, s, self.page_size) for s, _ in self.seqs), default=0)
        pages = []
        for j in range(best):
            owner = next(p for s, p in self.seqs if lcp_pages(tokens, s, self.page_size) > j)
            pages.append(owner[j])
        return pages


sequences = st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=14), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(sequences, st.sampled_from([1, 2, 4]), st.lists(st.lists(st.integers(0, 2), max_size=14), max_size=6))
def test_match_is_the_longest_cached_prefix_in_whole_pages(seqs: list[list[int]], page_size: int,
                                                           queries: list[list[int]]) -> None:
    tree, ref = RadixTree(page_size), Reference(page_size)
    next_page = 1
    for tokens in seqs:
        n = len(tokens) // page_size
        pages = array.array("q", range(next_page, next_page + n))
        next_page += n
        node, cached = tree.insert(np.array(tokens, dtype=np.int64), pages)
        expected = ref.match(tokens)  # what was cached before: those pages win, the rest are the new ones
        assert cached.tolist() == expected + pages.tolist()[len(expected):]
        assert node.path_pages() == cached
        ref.seqs.append((tokens[: n * page_size], cached.tolist()))
        for q in queries + [tokens]:
            node, got = tree.match(np.array(q, dtype=np.int64))
            assert got.tolist() == ref.match(q), (q, ref.seqs)
            assert node.path_pages() == got
    held = {p for node in tree.nodes() for p in node.pages}
    assert tree.num_pages == tree.evictable_pages == len(held) == sum(len(n.pages) for n in tree.nodes())


def test_eviction_is_lru_over_unpinned_leaves_and_parents_follow() -> None:
    tree = RadixTree(1)
    a, b, c = [1, 2, 3, 4], [1, 2, 7, 8], [5, 6]
    tree.insert(np.array(a), array.array("q", [10, 11, 12, 13]))
    tree.insert(np.array(b), array.array("q", [20, 21, 22, 23]))  # shares [1, 2] with a: pages 10, 11
    tree.insert(np.array(c), array.array("q", [30, 31]))
    assert tree.num_pages == 8 and tree.evictable_pages == 8
    tree.match(np.array(a))  # a is now the most recently used, then c, then b
    node, _ = tree.match(np.array(c))
    tree.pin(node)  # c cannot go
    assert tree.evictable_pages == 6
    assert sorted(tree.evict(1).tolist()) == [22, 23]  # b's own leaf, the least recently used
    assert tree.match(np.array(b))[1].tolist() == [10, 11]
    # a's leaf [3, 4] next; then [1, 2] (now a childless, unpinned parent); c stays pinned
    assert sorted(tree.evict(100).tolist()) == [10, 11, 12, 13]
    assert tree.num_pages == 2 and tree.evictable_pages == 0
    tree.unpin(node)
    assert tree.evictable_pages == 2 and sorted(tree.evict(5).tolist()) == [30, 31]
    assert tree.nodes() == [] and tree.num_pages == 0


def test_pins_hold_the_whole_path_through_splits() -> None:
    tree = RadixTree(2)
    leaf, _ = tree.insert(np.array([1, 2, 3, 4, 5, 6]), array.array("q", [1, 2, 3]))
    tree.pin(leaf)
    node, pages = tree.match(np.array([1, 2, 3, 4, 9, 9]))  # splits the node after two pages
    assert pages.tolist() == [1, 2] and node.ref == 1  # the new upper node carries the pin of the path below
    tree.pin(node)
    assert tree.evict(10).tolist() == [] and tree.evictable_pages == 0
    tree.unpin(leaf)
    assert tree.evictable_pages == 1 and tree.evict(10).tolist() == [3]
    tree.unpin(node)
    assert sorted(tree.evict(10).tolist()) == [1, 2]
