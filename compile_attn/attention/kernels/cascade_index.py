"""The device index of a shared-prefix (cascade) decode step: which requests share which prefix, and each request's
own slots after it.

Built from host lists (each group's batch indices and prefix length) plus the device request table, with one copy
of the host values and device gathers for the slots; nothing here syncs. A group's prefix slots are read from its
first member's ``req_to_token`` row: the members must hold the same slots there (the prefix cache lends them the
same pages), which ``check_shared_slots`` verifies in tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from compile_attn.attention.kernels.kv_index import build_kv_indices


@dataclass
class CascadeIndex:
    """Level 1: group ``g`` is requests ``group_reqs[group_indptr[g]:group_indptr[g+1]]`` (batch indices) sharing
    slots ``prefix_indices[prefix_indptr[g]:prefix_indptr[g+1]]``. Level 2: request ``b`` reads its own slots
    ``own_indices[own_indptr[b]:own_indptr[b+1]]`` (positions ``req_prefix_lens[b]`` to ``seq_len - 1``).
    Host ints size the level-1 grid."""

    batch_size: int
    num_groups: int
    max_group_size: int
    max_prefix_len: int
    prefix_indptr: torch.Tensor  # [G + 1] int32
    prefix_indices: torch.Tensor  # [>= total prefix] int32
    group_indptr: torch.Tensor  # [G + 1] int32
    group_reqs: torch.Tensor  # [>= members] int32
    req_prefix_lens: torch.Tensor  # [B] int32, 0 outside every group
    own_indptr: torch.Tensor  # [B + 1] int32
    own_indices: torch.Tensor  # [>= total own] int32


def check_groups(groups: Sequence[tuple[Sequence[int], int]], seq_lens: Sequence[int]) -> None:
    """ValueError unless every group names at least one request of the batch, no request is in two groups, and each
    prefix length is non-negative and shorter than every member's sequence (the step's new token is its own)."""
    seen: set[int] = set()
    for g, (members, prefix_len) in enumerate(groups):
        if not len(members):
            raise ValueError(f"shared-prefix group {g} has no requests; leave empty groups out")
        if prefix_len < 0:
            raise ValueError(f"shared-prefix group {g} has prefix length {prefix_len}; it must be >= 0")
        for b in members:
            if not 0 <= b < len(seq_lens):
                raise ValueError(f"shared-prefix group {g} names request {b}, outside the batch of {len(seq_lens)}")
            if b in seen:
                raise ValueError(f"request {b} is in two shared-prefix groups; a request shares at most one prefix")
            seen.add(b)
            if seq_lens[b] <= prefix_len:
                raise ValueError(f"request {b} of shared-prefix group {g} has seq_len {seq_lens[b]}, not longer than "
                                 f"the prefix length {prefix_len}")


def build_cascade_index(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    groups: Sequence[tuple[Sequence[int], int]],
    *,
    req_pool_indices_cpu: Sequence[int],
    seq_lens_cpu: Sequence[int],
) -> CascadeIndex:
    """The index of a decode batch whose requests ``groups[g][0]`` (batch indices) share their first
    ``groups[g][1]`` positions. ``req_pool_indices``/``seq_lens`` are the batch's device tensors and the ``*_cpu``
    arguments their host values."""
    seq_cpu = [int(n) for n in seq_lens_cpu]
    bs = len(seq_cpu)
    check_groups(groups, seq_cpu)
    device = req_to_token.device
    prefix_of = [0] * bs
    for members, prefix_len in groups:
        for b in members:
            prefix_of[b] = int(prefix_len)
    prefix_lens = [int(p) for _, p in groups]
    sizes = [len(m) for m, _ in groups]
    own_lens = [n - p for n, p in zip(seq_cpu, prefix_of)]
    host = [
        *_offsets(prefix_lens),
        *_offsets(sizes),
        *(int(b) for m, _ in groups for b in m),
        *prefix_of,
        *_offsets(own_lens),
    ]
    flat = torch.tensor(host, dtype=torch.int32).to(device, non_blocking=True)  # one copy
    cuts = [len(groups) + 1, len(groups) + 1, sum(sizes), bs, bs + 1]
    prefix_indptr, group_indptr, group_reqs, req_prefix_lens, own_indptr = torch.split(flat, cuts)
    spans = [req_to_token[int(req_pool_indices_cpu[m[0]]), :p] for m, p in groups if p > 0]
    prefix_indices = torch.cat(spans).to(torch.int32) if spans else torch.zeros(1, dtype=torch.int32, device=device)
    own_indices = torch.empty(max(sum(own_lens), 1), dtype=torch.int32, device=device)
    if sum(own_lens):
        build_kv_indices(req_to_token, req_pool_indices, seq_lens, own_indptr, own_indices, kv_start=req_prefix_lens)
    return CascadeIndex(
        batch_size=bs,
        num_groups=len(groups),
        max_group_size=max(sizes, default=0),
        max_prefix_len=max(prefix_lens, default=0),
        prefix_indptr=prefix_indptr,
        prefix_indices=prefix_indices,
        group_indptr=group_indptr,
        group_reqs=group_reqs if groups else torch.zeros(1, dtype=torch.int32, device=device),
        req_prefix_lens=req_prefix_lens,
        own_indptr=own_indptr,
        own_indices=own_indices,
    )


def _offsets(lens: Sequence[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def check_shared_slots(req_to_token: torch.Tensor, req_pool_indices_cpu: Sequence[int],
                       groups: Sequence[tuple[Sequence[int], int]]) -> None:
    """ValueError unless the members of each group hold the same slots at their first ``prefix_len`` positions
    (reads the device table: a sync; tests and debugging)."""
    for g, (members, prefix_len) in enumerate(groups):
        if len(members) < 2 or prefix_len == 0:
            continue
        rows = torch.tensor([int(req_pool_indices_cpu[b]) for b in members], device=req_to_token.device)
        table = req_to_token[rows, :prefix_len]
        differs = (table != table[:1]).any(dim=1)
        if bool(differs.any()):
            b = members[int(differs.nonzero()[0, 0])]
            raise ValueError(f"request {b} of shared-prefix group {g} does not hold the group's prefix slots in its "
                             f"first {prefix_len} positions")
