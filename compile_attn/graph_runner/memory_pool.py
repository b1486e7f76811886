"""The one CUDA graph memory pool shared by every capture in the process (full, piecewise, breakable)."""

from __future__ import annotations

import torch

_pool: object | None = None
_keepalive: torch.cuda.CUDAGraph | None = None


def get_graph_pool() -> object:
    """A handle from ``torch.cuda.graph_pool_handle()``, created on first use (CUDA only).

    The allocators free a graph pool when the last graph captured into it is destroyed; capturing into
    that stale handle again then fails an internal assertion (device and pinned-host allocators alike).
    A one-kernel graph captured into the pool and held for the life of the process keeps it alive, so
    runners and compiled models created one after another can all share it. Call outside a capture.
    """
    global _pool, _keepalive
    if _pool is None:
        pool = torch.cuda.graph_pool_handle()
        keepalive = torch.cuda.CUDAGraph()
        with torch.cuda.graph(keepalive, pool=pool):
            torch.zeros(1, device="cuda")
        _pool, _keepalive = pool, keepalive
    return _pool
