"""Prefix cache: the KV cache's radix tree of computed pages, lent to request rows that start with a cached prefix.

A row's first pages may be borrowed from the tree (pinned while the row holds them); the rest are its own. A
request that starts looks up its longest cached prefix (``match``, then ``attach``); a request's computed KV goes
into the tree (``insert``), after which the row reads the tree's pages (a page of its own that duplicates one the
tree already had is freed and the row's table entries point at the tree's); when a row is freed its own pages go
back to the allocator (``release``) and what it borrowed stays cached. Pages only the tree holds are evicted,
least recently used first, when an allocation needs them. ``page_account`` checks that every page is accounted
for exactly once (``kv/page_account.py``). It reads and changes a row's pages through the cache's row methods
(``CacheRows``), and imports nothing of the cache module (which imports it).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from compile_attn.host_tensors import to_device
from compile_attn.kv.allocator import PageAllocator
from compile_attn.kv.radix_tree import Node, RadixTree


class CacheRows(Protocol):
    """What the prefix cache asks of the KV cache it serves (``kv.cache.KVCache``)."""

    page_size: int
    device: torch.device
    allocator: PageAllocator

    @property
    def req_to_token(self) -> torch.Tensor: ...
    def row_pages(self, row: int) -> array.array | None: ...
    def row_len(self, row: int) -> int: ...
    def start_row(self, row: int, pages: Sequence[int], num_tokens: int) -> None: ...
    def replace_pages(self, row: int, indices: Sequence[int], pages: Sequence[int]) -> None: ...
    def rows_rewritten(self, rows: Sequence[int]) -> None: ...


@dataclass
class PrefixMatch:
    """A pinned cached prefix: ``pages`` (whole pages, in order) end at tree node ``node``."""

    node: Node
    pages: array.array


def _as_int64(tokens: array.array) -> np.ndarray:
    """A NumPy view of a copy of ``tokens`` (the request's own array stays resizable)."""
    return np.frombuffer(tokens[:], dtype=np.int64) if len(tokens) else np.empty(0, dtype=np.int64)


class PrefixCache:
    """The radix tree of a KVCache and the rows borrowing from it. Counters: ``num_lookup_tokens`` (tokens of the
    requests that looked up a prefix when they started) and ``num_hit_tokens`` (of those, tokens found cached)."""

    def __init__(self, kv: CacheRows) -> None:
        self.kv = kv
        self.page_size = kv.page_size
        self.tree = RadixTree(kv.page_size)
        self._held: dict[int, tuple[Node, int]] = {}  # row -> (deepest pinned node, pages borrowed from the tree)
        self.num_lookup_tokens = 0
        self.num_hit_tokens = 0

    @property
    def evictable_pages(self) -> int:
        """Pages only the tree holds: an allocation may evict them."""
        return self.tree.evictable_pages

    # ------------------------------------------------------------------ starting a request
    def match(self, tokens: array.array, limit: int) -> PrefixMatch:
        """The longest cached prefix of ``tokens[:limit]`` in whole pages, pinned until ``attach`` or ``unpin``."""
        node, pages = self.tree.match(_as_int64(tokens[:max(0, limit)]))
        self.tree.pin(node)
        return PrefixMatch(node, pages)

    def unpin(self, match: PrefixMatch) -> None:
        """Give up a match that was not attached."""
        self.tree.unpin(match.node)

    def attach(self, row: int, match: PrefixMatch, num_tokens: int) -> int:
        """Start the freshly allocated ``row`` (of a request of ``num_tokens`` tokens) with the matched pages; returns
        the tokens they hold, the request's first uncomputed position."""
        n = len(match.pages) * self.page_size
        self.kv.start_row(row, match.pages, n)
        self._held[row] = (match.node, len(match.pages))
        if n:
            self._write_table(row, range(len(match.pages)), match.pages)
        self.num_lookup_tokens += num_tokens
        self.num_hit_tokens += n
        return n

    # ------------------------------------------------------------------ caching computed KV
    def insert(self, row: int, tokens: array.array) -> None:
        """Cache the KV of ``tokens``, the first ``len(tokens)`` positions of ``row`` (computed, or computed by a
        step already launched), in whole pages. The row goes on reading them from the tree, pinned."""
        kv, ps = self.kv, self.page_size
        num_pages = len(tokens) // ps
        node, borrowed = self._held.get(row, (self.tree.root, 0))
        if num_pages <= borrowed:
            return
        held = kv.row_len(row)  # KeyError for a row that is not allocated
        own = kv.row_pages(row)
        assert own is not None
        if num_pages > len(own) or len(tokens) > held:
            raise ValueError(f"cannot cache {len(tokens)} tokens of request row {row}: it holds {held}")
        leaf, cached = self.tree.insert(_as_int64(tokens[:num_pages * ps]), own[:num_pages])
        mine = np.frombuffer(own[borrowed:num_pages], dtype=np.int64)
        theirs = np.frombuffer(cached[borrowed:num_pages], dtype=np.int64)
        dup = np.flatnonzero(mine != theirs)
        if dup.size:  # computed again while the tree already had them: read the tree's, free ours
            kv.allocator.free(mine[dup])
            kv.replace_pages(row, (dup + borrowed).tolist(), theirs[dup].tolist())
            self._write_table(row, (dup + borrowed).tolist(), theirs[dup])
        self.tree.pin(leaf)
        self.tree.unpin(node)
        self._held[row] = (leaf, num_pages)

    def _write_table(self, row: int, page_indices: range | list[int], pages: array.array | np.ndarray) -> None:
        """Point ``row``'s table entries of its pages ``page_indices`` at the slots of ``pages``."""
        kv, ps = self.kv, self.page_size
        offsets = np.arange(ps, dtype=np.int64)
        positions = (np.asarray(page_indices, dtype=np.int64)[:, None] * ps + offsets).ravel()
        slots = (np.asarray(pages, dtype=np.int64)[:, None] * ps + offsets).ravel()
        pos_t, slots_t = to_device([positions, slots], torch.int64, kv.device)
        kv.req_to_token[row, pos_t] = slots_t.to(torch.int32)
        kv.rows_rewritten([row])  # as after a free, no issued batch is trusted any more; a table mirror is told

    # ------------------------------------------------------------------ freeing and evicting
    def release(self, row: int, pages: array.array) -> array.array:
        """``row`` is being freed: unpin what it borrowed and return its own pages (the caller frees them)."""
        held = self._held.pop(row, None)
        if held is None:
            return pages
        node, borrowed = held
        self.tree.unpin(node)
        return pages[borrowed:]

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages only the tree holds, least recently used first; returns how many."""
        pages = self.tree.evict(num_pages)
        self.kv.allocator.free(pages)
        return len(pages)

    def clear(self) -> None:
        """Drop every unpinned cached prefix (all of them when no request is running)."""
        self.evict(self.tree.num_pages)

    def borrowed_pages(self, row: int) -> int:
        """Pages of ``row`` read from the tree (0 for a row that borrows none)."""
        return self.holding(row)[1]

    def holding(self, row: int) -> tuple[Node | None, int]:
        """The deepest tree node ``row`` pins and the pages it borrows from the tree (None, 0 for none)."""
        return self._held.get(row, (None, 0))
