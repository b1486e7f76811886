"""Index formats built from ``req_to_token``: token CSR (``kv_indptr``/``kv_indices``), page CSR, page table.

Pure torch functions, usable on any device. They take host-known sizes (``seq_lens_cpu``) where the
output size depends on them, so nothing here syncs with the device; backends that need
graph-recordable versions keep static buffers and fill them (see the triton backend's kernels).
"""

from __future__ import annotations

import torch


def build_kv_indptr(seq_lens: torch.Tensor) -> torch.Tensor:
    """``[B+1]`` int32 exclusive prefix sum of ``seq_lens``."""
    indptr = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    torch.cumsum(seq_lens, dim=0, out=indptr[1:])
    return indptr


def gather_token_table(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, width: int
) -> torch.Tensor:
    """``[B, width]`` slots of the first ``width`` positions of each request (static shape)."""
    return req_to_token[req_pool_indices, :width]


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    kv_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level CSR: request b's slots ``req_to_token[row_b, start_b:seq_len_b]``.

    ``kv_start`` (optional, per request) drops each request's first tokens (sliding-window decode).
    Returns ``(kv_indptr [B+1] int32, kv_indices [total] int32)``.
    """
    bs = req_pool_indices.shape[0]
    if bs == 0:
        empty = torch.zeros(1, dtype=torch.int32, device=req_to_token.device)
        return empty, empty[:0]
    width = int(seq_lens_cpu.max())
    pos = torch.arange(width, device=req_to_token.device)
    keep = pos[None, :] < seq_lens[:, None]
    lens = seq_lens
    if kv_start is not None:
        keep &= pos[None, :] >= kv_start[:, None]
        lens = seq_lens - kv_start
    table = gather_token_table(req_to_token, req_pool_indices, width)
    return build_kv_indptr(lens.to(torch.int32)), table[keep].to(torch.int32)


def build_page_table(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, num_pages: int, page_size: int
) -> torch.Tensor:
    """``[B, num_pages]`` int32 page ids (FA3 layout): page j of request b holds positions ``j*P..``.

    Entries past a request's last page point at the scratch page 0. Static-shaped, so it can be
    recorded in a CUDA graph.
    """
    cols = torch.arange(num_pages, device=req_to_token.device) * page_size
    cols = cols.clamp_(max=req_to_token.shape[1] - 1)
    return torch.div(req_to_token[req_pool_indices][:, cols], page_size, rounding_mode="floor").to(torch.int32)


def build_paged_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Page-level CSR (FlashInfer layout): ``(kv_page_indptr [B+1], kv_page_indices, kv_last_page_len [B])``."""
    device = req_to_token.device
    num_pages_cpu = (seq_lens_cpu + page_size - 1) // page_size
    last = torch.where(num_pages_cpu > 0, seq_lens_cpu - (num_pages_cpu - 1) * page_size, 0)
    indptr = build_kv_indptr(num_pages_cpu.to(device))
    if req_pool_indices.shape[0] == 0:
        return indptr, indptr[:0], last.to(device=device, dtype=torch.int32)
    width = int(num_pages_cpu.max())
    table = build_page_table(req_to_token, req_pool_indices, width, page_size)
    keep = torch.arange(width, device=device)[None, :] < num_pages_cpu.to(device)[:, None]
    return indptr, table[keep], last.to(device=device, dtype=torch.int32)
