"""FlashInfer's page-level CSR for one step, built from ``req_to_token`` without a device sync.

The host part (``page_csr``) turns host-known lengths into ``indptr`` and ``last_page_len``, what
``plan()`` reads, with a few NumPy ops and no torch op; the device part (Triton's
``build_page_indices``, one launch) gathers the page ids into a buffer of the size ``indptr`` says. A
CUDA-graph decode step does the host part before the replay and records the gather inside the graph
(``DecodeGraphState``); ``build_paged_kv`` does both, for eager steps. A request with length 0 has no
pages and ``last_page_len`` 0, which FlashInfer reads as an empty KV (its LSE is -inf).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from compile_attn.host_tensors import upload


@dataclass
class PagedKV:
    """Page CSR of one batch: ``indices[indptr[b]:indptr[b+1]]`` are request b's pages, in order."""

    indptr_cpu: torch.Tensor  # [B+1] int32, host
    indices: torch.Tensor  # [total_pages] int32, device
    last_page_len_cpu: torch.Tensor  # [B] int32, host; 1..page_size, 0 for an empty request
    lens_cpu: torch.Tensor  # [B] int64, host: tokens per request

    @property
    def batch_size(self) -> int:
        return int(self.last_page_len_cpu.shape[0])

    @property
    def total_pages(self) -> int:
        return int(self.indptr_cpu[-1])


@dataclass
class PageCSR:
    """The host half of a page CSR: ``packed`` is ``[indptr (B+1) | last_page_len (B)]`` in one int32 tensor
    (so one copy uploads both); ``indptr`` and ``last_page_len`` are views of it."""

    packed: torch.Tensor
    indptr: torch.Tensor
    last_page_len: torch.Tensor
    lens: torch.Tensor  # [B] int64

    @property
    def total_pages(self) -> int:
        return int(self.indptr[-1])


def page_csr(lens_cpu: torch.Tensor | Sequence[int], page_size: int) -> PageCSR:
    """``indptr`` (pages per request, prefix-summed) and ``last_page_len`` of requests of ``lens_cpu`` tokens."""
    lens = np.asarray(lens_cpu, dtype=np.int64)
    if lens.size and lens.min() < 0:
        raise ValueError(f"request lengths must be >= 0, got {lens.tolist()}")
    bs = lens.shape[0]
    num_pages = (lens + page_size - 1) // page_size
    ends = np.cumsum(num_pages)
    if bs and ends[-1] > np.iinfo(np.int32).max:
        raise OverflowError(f"{int(ends[-1])} pages overflow the int32 page indptr")
    packed = np.empty(2 * bs + 1, dtype=np.int32)
    packed[0] = 0
    packed[1 : bs + 1] = ends
    packed[bs + 1 :] = np.where(num_pages > 0, lens - (num_pages - 1) * page_size, 0)
    t = torch.from_numpy(packed)
    return PageCSR(packed=t, indptr=t[: bs + 1], last_page_len=t[bs + 1 :], lens=torch.from_numpy(lens))


def build_paged_kv(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    lens_cpu: torch.Tensor | Sequence[int],
    page_size: int,
) -> PagedKV:
    """Pages covering the first ``lens_cpu[b]`` tokens of request row ``req_pool_indices[b]``: the host CSR,
    one upload of ``indptr`` and one gather launch into a new ``indices`` tensor."""
    from compile_attn.attention.triton_ops import build_page_indices

    csr = page_csr(lens_cpu, page_size)
    if req_pool_indices.shape[0] != csr.lens.shape[0]:
        raise ValueError(f"{req_pool_indices.shape[0]} request rows but {csr.lens.shape[0]} lengths")
    total = csr.total_pages
    indices = torch.empty(total, dtype=torch.int32, device=req_to_token.device)
    if total:
        build_page_indices(req_to_token, req_pool_indices, upload(csr.indptr, req_to_token.device), indices,
                           page_size)
    return PagedKV(indptr_cpu=csr.indptr, indices=indices, last_page_len_cpu=csr.last_page_len, lens_cpu=csr.lens)
