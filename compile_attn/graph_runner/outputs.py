"""A replayed graph's outputs cut back to its batch's real tokens: the leading rows of a padded bucket
(``slice_tokens``), or named rows in the batch's order (``gather_rows``: a verify graph's end-aligned requests,
graph_runner/verify_layout.py). Leaves without the bucket's rows are passed through."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree


def slice_tokens(out: Any, bucket_tokens: int, real_tokens: int) -> Any:
    """The first ``real_tokens`` rows of every tensor of ``out`` that has the bucket's ``bucket_tokens`` rows."""
    if isinstance(out, torch.Tensor):  # the common case, without pytree's walk
        return out[:real_tokens] if out.dim() and out.shape[0] == bucket_tokens else out

    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == bucket_tokens:
            return x[:real_tokens]
        return x

    return pytree.tree_map(cut, out)


def gather_rows(out: Any, bucket_tokens: int, rows: torch.Tensor) -> Any:
    """The rows ``rows`` of every tensor of ``out`` that has the bucket's ``bucket_tokens`` rows, in that order."""

    def pick(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == bucket_tokens:
            return x.index_select(0, rows)
        return x

    return pick(out) if isinstance(out, torch.Tensor) else pytree.tree_map(pick, out)
