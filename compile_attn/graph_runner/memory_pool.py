"""The one CUDA graph memory pool shared by every capture in the process (full, piecewise, breakable)."""

from __future__ import annotations

import torch

_pool: object | None = None


def get_graph_pool() -> object:
    """A handle from ``torch.cuda.graph_pool_handle()``, created on first use (CUDA only)."""
    global _pool
    if _pool is None:
        _pool = torch.cuda.graph_pool_handle()
    return _pool
