"""A rank function that fails on purpose, for the test of ``run_ranks``'s error path. It imports no model code, so
its ranks start in about half the time of ``workers``'."""

from __future__ import annotations

import torch

from compile_attn.distributed import all_reduce


def failing_rank(rank: int, world_size: int) -> None:
    """Rank 1 raises before the first collective; the others wait in an all-reduce that never completes."""
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    all_reduce(torch.ones(4))
