"""Prefix cache: the KV cache's radix tree of computed pages, lent to request rows that start with a cached prefix.

A row's first pages may be borrowed from the tree (pinned while the row holds them); the rest are its own. A
request that starts looks up its longest cached prefix (``match``, then ``attach``); a request's computed KV goes
into the tree (``insert``), after which the row reads the tree's pages (a page of its own that duplicates one the
tree already had is freed and the row's table entries point at the tree's); when a row is freed its own pages go
back to the allocator (``release``) and what it borrowed stays cached. Pages only the tree holds are evicted,
least recently used first, when an allocation needs them. ``page_account`` checks that every page is accounted
for exactly once. Reaches into ``KVCache``'s per-row bookkeeping (``_pages``, ``_lens``), as ``BatchChecks`` does.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from compile_attn.errors import CompileAttnError
from compile_attn.host_tensors import to_device
from compile_attn.radix_tree import Node, RadixTree

if TYPE_CHECKING:
    from compile_attn.kv_cache import KVCache


class PageAccountError(CompileAttnError, AssertionError):
    """The KV cache's pages are not each free, held only by the prefix cache, or held by running requests."""


@dataclass
class PrefixMatch:
    """A pinned cached prefix: ``pages`` (whole pages, in order) end at tree node ``node``."""

    node: Node
    pages: array.array


@dataclass(frozen=True)
class PageAccount:
    """Where every page is: ``free + cached_only + running == total`` (``running`` counts a page shared by several
    rows once, and includes the tree's pages that rows borrow)."""

    free: int
    cached_only: int
    running: int
    total: int


def _as_int64(tokens: array.array) -> np.ndarray:
    """A NumPy view of a copy of ``tokens`` (the request's own array stays resizable)."""
    return np.frombuffer(tokens[:], dtype=np.int64) if len(tokens) else np.empty(0, dtype=np.int64)


class PrefixCache:
    """The radix tree of a KVCache and the rows borrowing from it. Counters: ``num_lookup_tokens`` (tokens of the
    requests that looked up a prefix when they started) and ``num_hit_tokens`` (of those, tokens found cached)."""

    def __init__(self, kv: KVCache) -> None:
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
        kv, ps = self.kv, self.page_size
        if kv._lens[row] or len(kv._pages[row]):
            raise ValueError(f"request row {row} already holds {kv._lens[row]} tokens; attach a prefix to a new row")
        n = len(match.pages) * ps
        kv._pages[row] = array.array("q", match.pages)
        kv._lens[row] = n
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
        own = kv._pages[row]
        if num_pages > len(own) or len(tokens) > kv._lens[row]:
            raise ValueError(f"cannot cache {len(tokens)} tokens of request row {row}: it holds {kv._lens[row]}")
        leaf, cached = self.tree.insert(_as_int64(tokens[:num_pages * ps]), own[:num_pages])
        mine = np.frombuffer(own[borrowed:num_pages], dtype=np.int64)
        theirs = np.frombuffer(cached[borrowed:num_pages], dtype=np.int64)
        dup = np.flatnonzero(mine != theirs)
        if dup.size:  # computed again while the tree already had them: read the tree's, free ours
            kv.allocator.free(mine[dup])
            for i in dup.tolist():
                own[borrowed + i] = cached[borrowed + i]
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
        kv._issued.clear()  # a row's slots changed: as after a free, no issued batch is trusted any more
        kv._generation += 1

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
        return self._held.get(row, (None, 0))[1]


def page_account(kv: KVCache) -> PageAccount:
    """Check that each page is exactly one of: free, held only by the prefix cache, held by running requests (their
    own, or borrowed from the tree with a pin for each row); that every row's table points at its pages; and that
    the tree's counters match its nodes. PageAccountError names the first page or row that breaks this."""
    ps, total = kv.page_size, kv.allocator.num_pages
    free = np.frombuffer(kv.allocator._free, dtype=np.int64) if kv.allocator.available else np.empty(0, np.int64)
    seen = np.zeros(total + 1, dtype=np.int64)
    np.add.at(seen, free, 1)
    cache = kv.prefix_cache
    nodes = cache.tree.nodes() if cache is not None else []
    pins: dict[int, int] = {}  # id(node) -> rows holding it or a node below it
    held = cache._held if cache is not None else {}
    for row, pages in kv._pages.items():
        node, borrowed = held.get(row, (None, 0))
        if node is not None:
            if pages[:borrowed] != node.path_pages():
                raise PageAccountError(f"request row {row} borrows pages {pages[:borrowed].tolist()} but the tree "
                                       f"path it pins holds {node.path_pages().tolist()}")
            while node is not None and node.parent is not None:
                pins[id(node)] = pins.get(id(node), 0) + 1
                node = node.parent
        np.add.at(seen, np.asarray(pages[borrowed:], dtype=np.int64), 1)
        need = -(-kv._lens[row] // ps)
        if len(pages) != need:
            raise PageAccountError(f"request row {row} holds {kv._lens[row]} tokens in {len(pages)} pages, not {need}")
        slots = (np.asarray(pages, dtype=np.int64)[:, None] * ps + np.arange(ps)).ravel()[:kv._lens[row]]
        table = kv.req_to_token[row, :kv._lens[row]].cpu().numpy()
        if not np.array_equal(table, slots):
            raise PageAccountError(f"request row {row}'s table entries are not the slots of its pages")
    cached_only = running_tree = 0
    for node in nodes:
        np.add.at(seen, np.asarray(node.pages, dtype=np.int64), 1)
        if node.ref != pins.get(id(node), 0):
            raise PageAccountError(f"a tree node of {len(node.pages)} pages has {node.ref} pins but "
                                   f"{pins.get(id(node), 0)} rows read it")
        if node.ref == 0:
            cached_only += len(node.pages)
        else:
            running_tree += len(node.pages)
        if node.parent is None or node.parent.children.get(node.key[:ps].tobytes()) is not node:
            raise PageAccountError("a tree node is not its parent's child under its first page")
    if seen[0]:
        raise PageAccountError("the scratch page 0 is free, cached or held by a request")
    bad = np.flatnonzero(seen[1:] != 1)
    if bad.size:
        page = int(bad[0]) + 1
        raise PageAccountError(f"page {page} is free, cached or held {int(seen[page])} times (exactly once expected); "
                               f"{bad.size} pages are off")
    if cache is not None and (cache.tree.evictable_pages != cached_only
                              or cache.tree.num_pages != cached_only + running_tree):
        raise PageAccountError(f"the tree counts {cache.tree.evictable_pages} evictable of {cache.tree.num_pages} "
                               f"pages but its nodes hold {cached_only} unpinned of {cached_only + running_tree}")
    running = total - len(free) - cached_only
    return PageAccount(free=len(free), cached_only=cached_only, running=running, total=total)
