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
    max_batch_size = len(lengths) + 3
    max_context = max([*lengths, 1]) + 5
    page_order = torch.randperm(num_pages - 1, generator=gen) + 1
    rows = torch.randperm(max_batch_size, generator=gen)[: len(lengths)]
    req_to_token = torch.zeros(max_batch_size, max_context, dtype=torch.int32)
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


def reference_decode(cache: PagedCache, q: torch.Tensor, starts: list[int], sm_scale: float, logit_cap: float = 0.0,
                     kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Each request's query (``q[b]``, one token) over its cached positions ``starts[b]`` on, in float64: over the
    cache's own buffers, or over ``kv`` (keys, values laid out like them: an fp8 cache's dequantised or original
    values)."""
    keys, values = kv if kv is not None else (cache.k_buffer, cache.v_buffer)
    outs = []
    for b in range(q.shape[0]):
        slots = cache.slots(b, starts[b])
        allowed = torch.ones(1, len(slots), dtype=torch.bool, device=q.device)
        outs.append(reference_attention(q[b:b + 1], keys[slots], values[slots], allowed, sm_scale, logit_cap))
    return torch.cat(outs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (0 when both are zero)."""
    err = (out.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    return err / scale if scale > 0 else err


TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def take_new_tokens(cache: PagedCache, bs: int, gen: torch.Generator, device: str = DEVICE) -> tuple:
    """Move each request's last token out of the cache, as a decode step's new K/V: returns strided fp32
    ``k_new``/``v_new`` views (one spare row, as in a padded graph batch), ``new_loc`` and the original
    cache rows. The cache slots are poisoned with NaN, so attending to them instead of k_new/v_new shows."""
    num_kv_heads, head_dim = cache.k_buffer.shape[1:]
    v_head_dim = cache.v_buffer.shape[-1]
    packed = torch.randn(bs + 1, num_kv_heads, head_dim + v_head_dim + 8, generator=gen).to(device)
    k_new, v_new = packed[:, :, :head_dim], packed[:, :, head_dim:head_dim + v_head_dim]
    new_loc = torch.zeros(bs + 1, dtype=torch.int64, device=device)  # empty requests keep scratch slot 0
    for b, n in enumerate(cache.lengths):
        if n:
            slot = cache.slots(b, 0)[-1]
            new_loc[b] = slot
            k_new[b], v_new[b] = cache.k_buffer[slot].float(), cache.v_buffer[slot].float()
    original = (cache.k_buffer.clone(), cache.v_buffer.clone())
    last = new_loc[: bs][torch.tensor(cache.lengths, device=device) > 0]
    cache.k_buffer[last] = float("nan")
    cache.v_buffer[last] = float("nan")
    return k_new, v_new, new_loc, original
