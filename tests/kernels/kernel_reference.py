"""Test helpers for the Triton kernels: a paged cache built page by page, and a float64 reference.

The reference never looks at kv_indptr/kv_indices: it gathers each request's keys from the cache
through req_to_token and builds masks from absolute positions, so index bugs show up as mismatches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PagedCache:
    """One layer's K/V buffers plus a req_to_token table holding ``lengths[b]`` positions of row ``rows[b]``."""

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor
    rows: torch.Tensor  # req_pool_indices, int32
    lengths: list[int]

    def slots(self, b: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        end = self.lengths[b] if end is None else end
        return self.req_to_token[int(self.rows[b]), start:end].long()


def make_paged_cache(
    lengths: list[int],
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: str = DEVICE,
    spare_pages: int = 3,
) -> PagedCache:
    """Give each request random distinct pages (never page 0, which holds scratch slot 0).

    Slot of position i of request b = page_b[i // P] * P + i % P. Unused table entries are 0.
    """
    pages_needed = [cdiv(n, page_size) for n in lengths]
    num_pages = 1 + sum(pages_needed) + spare_pages
    num_slots = num_pages * page_size
    max_requests = len(lengths) + 3
    max_context = max([*lengths, 1]) + 5
    page_order = torch.randperm(num_pages - 1, generator=gen) + 1
    rows = torch.randperm(max_requests, generator=gen)[: len(lengths)]
    req_to_token = torch.zeros(max_requests, max_context, dtype=torch.int32)
    taken = 0
    for b, n in enumerate(lengths):
        pages = page_order[taken : taken + pages_needed[b]]
        taken += pages_needed[b]
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        req_to_token[rows[b], :n] = slots.int()
    k_buffer = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_buffer = torch.randn(num_slots, num_kv_heads, v_head_dim, generator=gen).to(dtype)
    return PagedCache(
        k_buffer.to(device),
        v_buffer.to(device),
        req_to_token.to(device),
        rows.int().to(device),
        list(lengths),
    )


def csr_from_lengths(lengths: list[int], device: str = DEVICE) -> torch.Tensor:
    indptr = [0]
    for n in lengths:
        indptr.append(indptr[-1] + n)
    return torch.tensor(indptr, dtype=torch.int32, device=device)


def reference_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    sm_scale: float,
    logit_cap: float = 0.0,
) -> torch.Tensor:
    """float64 softmax attention: q [M, Hq, D], keys [N, Hkv, D], values [N, Hkv, Dv], allowed [M, N].

    Query head h reads KV head h // (Hq // Hkv). Rows with nothing allowed give zeros.
    """
    num_q_heads, num_kv_heads = q.shape[1], keys.shape[1]
    group = num_q_heads // num_kv_heads
    kv_head = torch.arange(num_q_heads, device=q.device) // group
    k = keys.double()[:, kv_head]  # [N, Hq, D]
    v = values.double()[:, kv_head]
    scores = torch.einsum("mhd,nhd->hmn", q.double(), k) * sm_scale
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("hmn,nhd->mhd", probs, v)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (0 when both are zero)."""
    err = (out.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    return err / scale if scale > 0 else err


TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}
