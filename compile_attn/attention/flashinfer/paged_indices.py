"""FlashInfer's page-level CSR for one step, built from ``req_to_token`` without a device sync.

The host part (``page_csr``) turns host-known lengths into ``indptr`` and ``last_page_len``, what
``plan()`` reads, in plain Python (no torch op); the device part (Triton's
``build_page_indices``, one launch) gathers the page ids into a buffer of the size ``indptr`` says. A
CUDA-graph decode step does the host part before the replay and records the gather inside the graph
(``DecodeGraphState``); ``build_paged_kv`` does both, for eager steps. A request with length 0 has no
pages and ``last_page_len`` 0, which FlashInfer reads as an empty KV (its LSE is -inf).
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from compile_attn.host_tensors import upload


@dataclass
class PagedKV:
    """Page CSR of one batch: ``indices[indptr[b]:indptr[b+1]]`` are request b's pages, in order."""

    indptr_cpu: torch.Tensor  # [B+1] int32, host
    indices: torch.Tensor  # [total_pages] int32, device
    last_page_len_cpu: torch.Tensor  # [B] int32, host; 1..page_size, 0 for an empty request

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
    total_pages: int

    @property
    def batch_size(self) -> int:
        return int(self.last_page_len.shape[0])


def page_csr(lens_cpu: torch.Tensor | Sequence[int], page_size: int) -> PageCSR:
    """``indptr`` (pages per request, prefix-summed) and ``last_page_len`` of requests of ``lens_cpu`` tokens.

    Plain Python into one ``array.array``: at decode batch sizes that is cheaper than NumPy or torch ops, each
    a dispatch of its own (docs/performance.md). A total that overflows int32 raises OverflowError.
    """
    lens = lens_cpu.tolist() if isinstance(lens_cpu, torch.Tensor) else list(lens_cpu)
    if lens and min(lens) < 0:
        raise ValueError(f"request lengths must be >= 0, got {lens}")
    if page_size == 1:
        pages, last = lens, [1 if n else 0 for n in lens]
    else:
        pages = [-(-n // page_size) for n in lens]
        last = [n - (p - 1) * page_size if n else 0 for n, p in zip(lens, pages)]
    packed = array.array("i", [0])
    packed.extend(itertools.accumulate(pages))
    total = packed[-1]
    packed.extend(last)
    bs = len(lens)
    t = torch.frombuffer(packed, dtype=torch.int32)
    return PageCSR(packed=t, indptr=t[: bs + 1], last_page_len=t[bs + 1 :], total_pages=total)


def build_paged_kv(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    lens_cpu: torch.Tensor | Sequence[int],
    page_size: int,
) -> PagedKV:
    """Pages covering the first ``lens_cpu[b]`` tokens of request row ``req_pool_indices[b]``: the host CSR,
    one upload of ``indptr`` and one gather launch into a new ``indices`` tensor."""
    from compile_attn.attention.kernels import build_page_indices

    csr = page_csr(lens_cpu, page_size)
    if req_pool_indices.shape[0] != csr.batch_size:
        raise ValueError(f"{req_pool_indices.shape[0]} request rows but {csr.batch_size} lengths")
    total = csr.total_pages
    indices = torch.empty(total, dtype=torch.int32, device=req_to_token.device)
    if total:
        build_page_indices(req_to_token, req_pool_indices, upload(csr.indptr, req_to_token.device), indices,
                           page_size)
    return PagedKV(indptr_cpu=csr.indptr, indices=indices, last_page_len_cpu=csr.last_page_len)
