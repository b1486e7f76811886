"""SamplingPlan: host-side facts about one batch's rows that choose which sampling kernels run.

Built from the requests' parameters on the host (no device sync), or from the parameter tensors with one
sync. A row with temperature 0 is greedy: its filters are ignored and it counts as a plain row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingPlan:
    """``plain_rows``: some row is greedy or has no top-k / top-p (min_p alone is allowed), so the
    full-vocabulary Gumbel-max kernel runs. ``filtered_rows``: some sampled row has top-k or top-p.
    ``max_top_k``: the largest top_k of a filtered row (0: none). ``top_p_without_top_k``: some filtered
    row has top-p and no top-k (its candidates are the whole vocabulary). ``top_p_rows`` / ``min_p_rows``:
    some filtered row uses top-p / some sampled row uses min_p. ``flashinfer_eligible``: no filtered row
    has an explicit seed or min_p, so FlashInfer's kernels (one random stream per call, no min_p with
    top-k / top-p) may sample the filtered rows; otherwise they use the seeded hash path."""

    plain_rows: bool = True
    filtered_rows: bool = False
    max_top_k: int = 0
    top_p_without_top_k: bool = False
    top_p_rows: bool = False
    min_p_rows: bool = False
    flashinfer_eligible: bool = False

    @classmethod
    def for_rows(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int] | None = None,
        top_p: Sequence[float] | None = None,
        min_p: Sequence[float] | None = None,
        seeded: Sequence[bool] | bool = True,
    ) -> SamplingPlan:
        """The plan for rows given as host lists (None: the filter is off for every row). ``seeded[i]``: row
        i must give the same tokens whatever its batch (an explicit seed)."""
        n = len(temperature)
        top_k = top_k if top_k is not None else [0] * n
        top_p = top_p if top_p is not None else [1.0] * n
        min_p = min_p if min_p is not None else [0.0] * n
        seeded = [seeded] * n if isinstance(seeded, bool) else seeded
        plain = filtered = p_only = any_p = any_min_p = hash_only = False
        max_k = 0
        for t, k, p, m, s in zip(temperature, top_k, top_p, min_p, seeded):
            any_min_p |= t > 0 and m > 0
            if t <= 0 or (k <= 0 and p >= 1.0):
                plain = True
                continue
            filtered = True
            max_k = max(max_k, k)
            p_only |= k <= 0
            any_p |= p < 1.0
            hash_only |= s or m > 0
        return cls(plain, filtered, max_k, p_only, any_p, any_min_p, filtered and not hash_only)

    @classmethod
    def from_tensors(
        cls,
        temperature: torch.Tensor,
        top_k: torch.Tensor | None = None,
        top_p: torch.Tensor | None = None,
        min_p: torch.Tensor | None = None,
        seeded: bool = True,
    ) -> SamplingPlan:
        """The plan for rows given as device tensors: one host sync (pass a plan to ``sample`` to avoid it)."""
        n = temperature.shape[0]
        cols = [temperature.float()]
        cols.append(top_k.to(temperature.device).float() if top_k is not None else torch.zeros_like(cols[0]))
        cols.append(top_p.float() if top_p is not None else torch.ones_like(cols[0]))
        cols.append(min_p.float() if min_p is not None else torch.zeros_like(cols[0]))
        t, k, p, m = torch.stack(cols).cpu().tolist() if n else ([], [], [], [])
        return cls.for_rows(t, [int(v) for v in k], p, m, seeded)
