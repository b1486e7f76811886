"""Shared-prefix decode through FlashInfer's two-level ``MultiLevelCascadeAttentionWrapper``.

Level 0 gives each shared-prefix group one query segment (its members' rows, made contiguous by a permutation of
the batch) over the group's prefix pages; level 1 gives every request its own pages; FlashInfer merges the two by
their log-sum-exp (``merge_state_in_place``). Requests in no group form a last level-0 segment with no pages (an
empty KV, LSE -inf, which the merge ignores). FlashInfer reads whole pages, so each group's prefix must end on a
page boundary (the prefix cache shares whole pages only). Plans take host lists and make one upload and one
gather; eager use only (the plan's shapes follow the groups).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from compile_attn.attention.flashinfer.library import INSTALL_HINT
from compile_attn.errors import BackendUnavailableError


@dataclass
class CascadePages:
    """The two levels' page CSRs, for the batch permuted by ``order`` (``order[i]`` is the batch index at row i)."""

    order: list[int]
    qo_indptr: list[torch.Tensor]  # per level, int32 on the device
    kv_indptr: list[torch.Tensor]
    kv_indices: list[torch.Tensor]
    last_page_len: list[torch.Tensor]


def _csr(lens: list[int], page_size: int) -> tuple[list[int], list[int], list[int]]:
    """(pages per entry, indptr, last_page_len; 0 for an empty entry)."""
    pages = [-(-n // page_size) for n in lens]
    indptr = [0, *np.cumsum(pages, dtype=np.int64).tolist()]
    last = [n - (p - 1) * page_size if n else 0 for n, p in zip(lens, pages)]
    return pages, indptr, last


def cascade_pages(
    req_to_token: torch.Tensor,
    req_pool_indices_cpu: Sequence[int],
    seq_lens_cpu: Sequence[int],
    groups: Sequence[tuple[Sequence[int], int]],
    page_size: int,
) -> CascadePages:
    """Level 0: one segment per group over its prefix pages (read from its first member's row), then one empty
    segment for the requests in no group (if any); level 1: each request's pages from its prefix's end. ValueError for a
    prefix that does not end on a page boundary."""
    from compile_attn.attention.kernels.cascade_index import check_groups

    seq = [int(n) for n in seq_lens_cpu]
    check_groups(groups, seq)
    for g, (_, p) in enumerate(groups):
        if p % page_size:
            raise ValueError(f"shared-prefix group {g} has prefix length {p}, not a multiple of the page size "
                             f"{page_size}; FlashInfer's cascade reads whole pages")
    grouped = [b for members, _ in groups for b in members]
    rest = sorted(set(range(len(seq))) - set(grouped))
    order = grouped + rest
    prefix_of = dict.fromkeys(range(len(seq)), 0)
    for members, p in groups:
        prefix_of.update(dict.fromkeys(members, p))
    tail = [len(rest)] if rest else []  # the requests in no group: one level-0 segment with no pages
    sizes = [len(m) for m, _ in groups] + tail
    qo0 = [0, *np.cumsum(sizes, dtype=np.int64).tolist()]
    # Positions whose pages each level reads: a page's first position, for every page of every entry.
    rows0 = [int(req_pool_indices_cpu[m[0]]) for m, _ in groups] + [0] * len(tail)
    starts0, lens0 = [0] * len(rows0), [p for _, p in groups] + [0] * len(tail)
    rows1 = [int(req_pool_indices_cpu[b]) for b in order]
    starts1 = [prefix_of[b] for b in order]
    lens1 = [seq[b] - prefix_of[b] for b in order]
    host, gathers = [], []
    for rows, starts, lens in ((rows0, starts0, lens0), (rows1, starts1, lens1)):
        pages, indptr, last = _csr(lens, page_size)
        total = indptr[-1]
        entry = np.repeat(np.arange(len(pages)), pages)
        within = np.arange(total) - np.repeat(np.asarray(indptr[:-1], dtype=np.int64), pages)
        positions = np.asarray(starts, dtype=np.int64)[entry] + within * page_size
        gathers.append((np.asarray(rows, dtype=np.int64)[entry], positions))
        host.append((indptr, last))
    device = req_to_token.device
    qo1 = list(range(len(order) + 1))
    flat = torch.tensor([*qo0, *qo1, *host[0][0], *host[0][1], *host[1][0], *host[1][1]], dtype=torch.int32)
    flat = flat.to(device)
    cuts = [len(qo0), len(qo1), len(host[0][0]), len(host[0][1]), len(host[1][0]), len(host[1][1])]
    qo0_t, qo1_t, ind0, last0, ind1, last1 = torch.split(flat, cuts)
    indices = []
    for rows, positions in gathers:
        if len(rows):
            idx = torch.from_numpy(np.stack([rows, positions])).to(device)
            indices.append((req_to_token[idx[0], idx[1]] // page_size).to(torch.int32))
        else:
            indices.append(torch.zeros(1, dtype=torch.int32, device=device))
    return CascadePages(order=order, qo_indptr=[qo0_t, qo1_t], kv_indptr=[ind0, ind1], kv_indices=indices,
                        last_page_len=[last0, last1])


class FlashInferCascadeDecode:
    """``plan`` once per decode step (groups, lengths, head shape), ``run`` once per layer."""

    def __init__(self, workspace: torch.Tensor) -> None:
        try:
            fi = importlib.import_module("flashinfer")
            wrapper_cls = fi.MultiLevelCascadeAttentionWrapper
        except (ImportError, AttributeError) as exc:
            raise BackendUnavailableError(
                f"shared-prefix decode with FlashInfer needs flashinfer's MultiLevelCascadeAttentionWrapper "
                f"({exc}); install it with: {INSTALL_HINT}; or use the triton cascade kernels "
                f"(compile_attn.attention.kernels.cascade_attention)") from exc
        self.wrapper = wrapper_cls(2, workspace, "NHD")
        self.pages: CascadePages | None = None
        self.page_size = 1
        self._permute: torch.Tensor | None = None

    def plan(self, req_to_token: torch.Tensor, req_pool_indices_cpu: Sequence[int], seq_lens_cpu: Sequence[int],
             groups: Sequence[tuple[Sequence[int], int]], *, page_size: int, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, sm_scale: float, logit_cap: float = 0.0, q_dtype: torch.dtype = torch.bfloat16,
             kv_dtype: torch.dtype = torch.bfloat16) -> None:
        pages = cascade_pages(req_to_token, req_pool_indices_cpu, seq_lens_cpu, groups, page_size)
        self.wrapper.plan(pages.qo_indptr, pages.kv_indptr, pages.kv_indices, pages.last_page_len, num_qo_heads,
                          num_kv_heads, head_dim, page_size, causal=False, sm_scale=sm_scale,
                          logits_soft_cap=logit_cap if logit_cap > 0 else None, q_data_type=q_dtype,
                          kv_data_type=kv_dtype)
        self.pages, self.page_size = pages, page_size
        identity = pages.order == list(range(len(pages.order)))
        self._permute = None if identity else torch.tensor(pages.order, device=req_to_token.device)

    def run(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor) -> None:
        """Attention of ``q[B, Hq, D]`` over the slot buffers ``[S, Hkv, D]`` into ``out[B, Hq, Dv]``."""
        if self.pages is None:
            raise RuntimeError("FlashInferCascadeDecode.run before plan(): plan each decode step first")
        ps = self.page_size
        paged = (k_buffer.view(-1, ps, *k_buffer.shape[1:]), v_buffer.view(-1, ps, *v_buffer.shape[1:]))
        if self._permute is None:
            out.copy_(self.wrapper.run(q, paged))
        else:
            out.index_copy_(0, self._permute, self.wrapper.run(q.index_select(0, self._permute), paged))
