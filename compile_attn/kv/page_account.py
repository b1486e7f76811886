"""``page_account``: the check that every page of a KV cache is accounted for exactly once.

A page is free, held only by the prefix cache's tree, or held by running request rows (their own, or borrowed from
the tree with a pin for each row); every row's table points at its pages. Reads the cache and its prefix cache
through their public methods; changes nothing (tests and debugging).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from compile_attn.errors import CompileAttnError

if TYPE_CHECKING:
    from compile_attn.kv.cache import KVCache


class PageAccountError(CompileAttnError, AssertionError):
    """The KV cache's pages are not each free, held only by the prefix cache, or held by running requests."""


@dataclass(frozen=True)
class PageAccount:
    """Where every page is: ``free + cached_only + running == total`` (``running`` counts a page shared by several
    rows once, and includes the tree's pages that rows borrow)."""

    free: int
    cached_only: int
    running: int
    total: int


def page_account(kv: KVCache) -> PageAccount:
    """Check that each page is exactly one of: free, held only by the prefix cache, held by running requests (their
    own, or borrowed from the tree with a pin for each row); that every row's table points at its pages; and that
    the tree's counters match its nodes. PageAccountError names the first page or row that breaks this."""
    ps, total = kv.page_size, kv.allocator.num_pages
    free = kv.allocator.free_pages()
    seen = np.zeros(total + 1, dtype=np.int64)
    np.add.at(seen, free, 1)
    cache = kv.prefix_cache
    nodes = cache.tree.nodes() if cache is not None else []
    pins: dict[int, int] = {}  # id(node) -> rows holding it or a node below it
    for row, pages, num_tokens in kv.held_rows():
        node, borrowed = cache.holding(row) if cache is not None else (None, 0)
        if node is not None:
            if pages[:borrowed] != node.path_pages():
                raise PageAccountError(f"request row {row} borrows pages {pages[:borrowed].tolist()} but the tree "
                                       f"path it pins holds {node.path_pages().tolist()}")
            while node is not None and node.parent is not None:
                pins[id(node)] = pins.get(id(node), 0) + 1
                node = node.parent
        np.add.at(seen, np.asarray(pages[borrowed:], dtype=np.int64), 1)
        need = -(-num_tokens // ps)
        if len(pages) != need:
            raise PageAccountError(f"request row {row} holds {num_tokens} tokens in {len(pages)} pages, not {need}")
        slots = (np.asarray(pages, dtype=np.int64)[:, None] * ps + np.arange(ps)).ravel()[:num_tokens]
        table = kv.req_to_token[row, :num_tokens].cpu().numpy()
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
