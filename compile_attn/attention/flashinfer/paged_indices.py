"""FlashInfer's page-level CSR for one step, built from ``req_to_token`` without a device sync.

Host-known lengths give ``kv_indptr`` and ``kv_last_page_len`` on the CPU (what ``plan()`` reads);
the page ids are gathered on the device with a fixed output size. A request with length 0 has no
pages and ``last_page_len`` 0, which FlashInfer reads as an empty KV (its LSE is -inf).
"""

from __future__ import annotations

from dataclasses import dataclass

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


def build_paged_kv(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    lens_cpu: torch.Tensor | list[int],
    page_size: int,
    *,
    indptr_out: torch.Tensor | None = None,
    indices_out: torch.Tensor | None = None,
) -> PagedKV:
    """Pages covering the first ``lens_cpu[b]`` tokens of request row ``req_pool_indices[b]``.

    ``indptr_out``/``indices_out`` (device buffers, e.g. a graph's static ones) receive the device
    ``indptr`` and the page ids; ``PagedKV.indices`` is then a view of ``indices_out``.
    """
    device = req_to_token.device
    lens = torch.as_tensor(lens_cpu, dtype=torch.int64).cpu()
    bs = int(lens.shape[0])
    num_pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(bs + 1, dtype=torch.int32)
    if bs:
        torch.cumsum(num_pages, dim=0, dtype=torch.int32, out=indptr[1:])
    last = torch.where(num_pages > 0, lens - (num_pages - 1) * page_size, torch.zeros_like(lens)).to(torch.int32)
    total = int(indptr[-1])
    if indices_out is not None and total > indices_out.numel():
        raise ValueError(f"{total} pages do not fit the {indices_out.numel()}-entry page-index buffer")
    indices = indices_out[:total] if indices_out is not None else torch.empty(total, dtype=torch.int32, device=device)
    if indptr_out is not None:
        indptr_dev = indptr_out[: bs + 1]
        indptr_dev.copy_(upload(indptr, device), non_blocking=True)
    elif total:
        indptr_dev = upload(indptr, device)
    if total:
        counts = indptr_dev[1:] - indptr_dev[:-1]
        req_of = torch.repeat_interleave(torch.arange(bs, device=device), counts, output_size=total)
        page_no = torch.arange(total, device=device) - indptr_dev[:-1][req_of]
        rows = req_pool_indices[req_of]
        if page_size == 1:
            indices.copy_(req_to_token[rows, page_no])
        else:
            torch.div(req_to_token[rows, page_no * page_size], page_size, rounding_mode="floor", out=indices)
    return PagedKV(indptr_cpu=indptr, indices=indices, last_page_len_cpu=last, lens_cpu=lens)
