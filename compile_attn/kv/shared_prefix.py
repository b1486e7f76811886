"""Which requests of a decode batch share a cached prefix: the description a shared-prefix (cascade) decode reads.

A group is batch indices whose request rows hold the same KV pages for their first ``prefix_len`` positions (the
prefix cache lends one set of tree pages to every row that matched them). Whoever builds a decode batch sets
``ForwardBatch.shared_prefix``; backends only read it. ``find_shared_prefixes`` finds the groups from the KV cache's
host page lists (identical leading page ids), ``SharedPrefixFinder`` remembers them while a batch keeps its rows,
and ``engine_prefix_finder`` is the one switch (``EngineConfig.cascade_decode``): the engine sets the groups of its
decode batches so that the graph runner routes them to the backend's shared-prefix path.
Only whole shared pages count, and each member keeps at least one position of its own (the step's new token). Reads
the cache's host page lists only (``KVCache.row_pages``); knows no backend.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from compile_attn import env
from compile_attn.batch import SharedPrefixGroup

if TYPE_CHECKING:
    from compile_attn.batch import ForwardBatch
    from compile_attn.kv.cache import KVCache

logger = logging.getLogger(__name__)

# A group worth a cascade pass: this many requests sharing at least this many tokens (below that, plain decode).
MIN_REQUESTS = 4
MIN_TOKENS = 256


def find_shared_prefixes(
    kv: KVCache,
    rows: Sequence[int],
    seq_lens: Sequence[int],
    *,
    min_requests: int = MIN_REQUESTS,
    min_tokens: int = MIN_TOKENS,
) -> tuple[SharedPrefixGroup, ...]:
    """Groups of the batch whose request rows (``rows[b]``, holding ``seq_lens[b]`` positions) start with the same
    page ids: requests are grouped by their first page, and a group's prefix is the pages all its members hold in
    the same order, cut so that every member keeps its last position to itself. Groups with fewer than
    ``min_requests`` members or a prefix shorter than ``min_tokens`` are left out. Host page lists only: no device
    access. Pages are shared only through the prefix cache, so without one there are no groups."""
    if kv.prefix_cache is None:
        return ()
    ps = kv.page_size
    by_first: dict[int, list[int]] = {}
    for b, row in enumerate(rows):
        pages = kv.row_pages(row)
        if pages is not None and len(pages) and seq_lens[b] > ps:
            by_first.setdefault(pages[0], []).append(b)
    groups = []
    for members in by_first.values():
        if len(members) < min_requests:
            continue
        # Whole pages before each member's last position: the page holding the new token is never shared.
        limit = min((seq_lens[b] - 1) // ps for b in members)
        table = np.stack([np.frombuffer(kv.row_pages(rows[b]), dtype=np.int64)[:limit] for b in members])
        same = (table == table[:1]).all(axis=0)
        num_pages = int(limit if same.all() else np.argmin(same))
        if num_pages * ps >= min_tokens:
            groups.append(SharedPrefixGroup(tuple(members), num_pages * ps))
    return tuple(groups)


class SharedPrefixFinder:
    """The shared-prefix groups of decode batches that ``find_shared_prefixes`` finds (at least ``min_requests``
    requests sharing ``min_tokens`` tokens), remembered while the batch keeps the same rows: a row's shared pages
    never change while it holds them, and freeing or truncating a row changes the cache's generation."""

    def __init__(self, kv: KVCache, *, min_requests: int = MIN_REQUESTS, min_tokens: int = MIN_TOKENS) -> None:
        self.kv = kv
        self.min_requests, self.min_tokens = min_requests, min_tokens
        self._memo: tuple[tuple, tuple[SharedPrefixGroup, ...]] | None = None

    def groups_for(self, fb: ForwardBatch) -> tuple[SharedPrefixGroup, ...]:
        if fb.req_pool_indices_cpu is None:
            return ()
        key = (self.kv.generation, tuple(fb.req_pool_indices_cpu))
        if self._memo is None or self._memo[0] != key:
            groups = find_shared_prefixes(self.kv, fb.req_pool_indices_cpu, fb.seq_lens_cpu.tolist(),
                                          min_requests=self.min_requests, min_tokens=self.min_tokens)
            self._memo = (key, groups)
        return self._memo[1]


def engine_prefix_finder(option: bool | None, kv: KVCache, backend_name: str,
                         backend_takes_groups: bool) -> SharedPrefixFinder | None:
    """The finder whose groups the engine puts on its decode batches (``fb.shared_prefix``), or None when it sets
    none: ``option`` False, or None with ``COMPILE_ATTN_CASCADE_DECODE`` unset; no prefix cache (pages are shared
    only through it); or a backend without a shared-prefix decode path (``backend_takes_groups``: its
    ``takes_shared_prefix_decode()``)."""
    on = env.cascade_decode() if option is None else bool(option)
    if not on:
        return None
    if kv.prefix_cache is None or not backend_takes_groups:
        logger.info("cascade_decode: off, %s", "the prefix cache is off" if kv.prefix_cache is None else
                    f"attention backend {backend_name!r} has no shared-prefix decode path for this model")
        return None
    return SharedPrefixFinder(kv)
