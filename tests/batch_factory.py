"""Random batches over a real KVCache for tests: allocate requests, fill prefixes, allocate new slots."""

from __future__ import annotations

import array

from dataclasses import dataclass

import torch

from compile_attn import ForwardBatch, ForwardMode, KVCache


@dataclass
class RandomStep:
    batch: ForwardBatch
    rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def fill_prefixes(kv: KVCache, rows: list[int], prefix_lens: list[int], gen: torch.Generator) -> None:
    """Allocate and write random K/V for each request's prefix, in every layer."""
    loc = kv.alloc_extend(rows, prefix_lens)
    pool = kv.pool
    for layer_id in range(pool.num_layers):
        n = loc.shape[0]
        k = torch.randn(n, pool.num_kv_heads, pool.head_dim, generator=gen).to(pool.device)
        v = torch.randn(n, pool.num_kv_heads, pool.v_head_dim, generator=gen).to(pool.device)
        pool.set_kv(layer_id, loc, k, v)


def random_step(
    kv: KVCache,
    prefix_lens: list[int],
    extend_lens: list[int],
    num_q_heads: int,
    gen: torch.Generator,
    dtype: torch.dtype | None = None,
    forward_mode: ForwardMode | None = None,
    shuffle_pages: bool = True,
) -> RandomStep:
    """New requests with random cached prefixes, then a step adding ``extend_lens`` tokens to each."""
    pool = kv.pool
    dtype = dtype or pool.dtype
    if shuffle_pages:  # scatter pages so requests do not occupy contiguous slots
        perm = torch.randperm(kv.allocator.available, generator=gen).tolist()
        free = kv.allocator._free
        kv.allocator._free = array.array("q", [free[i] for i in perm])
    rows = [kv.alloc_request() for _ in prefix_lens]
    fill_prefixes(kv, rows, list(prefix_lens), gen)
    loc = kv.alloc_extend(rows, list(extend_lens))
    fb = ForwardBatch.build(
        req_pool_indices=rows, prefix_lens=prefix_lens, extend_lens=extend_lens, out_cache_loc=loc,
        forward_mode=forward_mode, device=pool.device,
    )
    t = sum(extend_lens)
    q = torch.randn(t, num_q_heads, pool.head_dim, generator=gen).to(device=pool.device, dtype=dtype)
    k = torch.randn(t, pool.num_kv_heads, pool.head_dim, generator=gen).to(device=pool.device, dtype=dtype)
    v = torch.randn(t, pool.num_kv_heads, pool.v_head_dim, generator=gen).to(device=pool.device, dtype=dtype)
    return RandomStep(fb, rows, list(prefix_lens), list(extend_lens), q, k, v)
