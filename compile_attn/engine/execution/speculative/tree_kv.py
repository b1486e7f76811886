"""After a tree's verification: the accepted path's KV moved into place.

A verify step writes the KV of a request's root and draft nodes at consecutive positions of its row, in the tree's
order. The accepted path (root, then one node per accepted depth) must end up at consecutive positions from the
root's: a node at depth d moves to ``base + d`` from ``base + node``. Nodes are listed parents first, so a node's
index is at least its depth and no move overwrites a source that a later move reads. One gather and one scatter per
layer and K/V buffer, on the device, where the path is not already in place (a chain, or the tree's first branch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from compile_attn.host_tensors import to_device
from compile_attn.kv.cache import KVCache


def slots_at(kv_cache: KVCache, row: int, positions: Sequence[int]) -> list[int]:
    """The KV slots of ``positions`` of request ``row``."""
    pages, ps = kv_cache.row_pages(row), kv_cache.page_size
    assert pages is not None, f"request row {row} is not allocated"
    return [pages[p // ps] * ps + p % ps for p in positions]


def move_accepted_path(kv_cache: KVCache, row: int, base: int, nodes: Sequence[int]) -> bool:
    """Move the KV of path ``nodes`` (indices of the step's tokens from ``base``, the root first) to positions
    ``base .. base + len(nodes) - 1`` of ``row``. Returns whether anything moved."""
    moves = [(base + node, base + depth) for depth, node in enumerate(nodes) if node != depth]
    if not moves:
        return False
    src = slots_at(kv_cache, row, [s for s, _ in moves])
    dst = slots_at(kv_cache, row, [d for _, d in moves])
    src_t, dst_t = to_device([src, dst], torch.int64, kv_cache.device)
    pool = kv_cache.pool
    for buffers in (pool.k_buffers, pool.v_buffers):
        for buf in buffers:
            raw = buf.view(torch.uint8) if buf.element_size() == 1 else buf  # fp8: copied as bytes
            raw.index_copy_(0, dst_t, raw.index_select(0, src_t))
    return True
