"""Random batches over a real KVCache for tests: allocate requests, fill prefixes, allocate new slots."""

from __future__ import annotations

import array
from dataclasses import dataclass, field

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
    prefix_loc: torch.Tensor | None = None  # the prefixes' slots
    prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # per layer, as written


# Per-KV-head factors for K and for V ([1, num_kv_heads, 1] each), so that the heads differ in magnitude.
Gains = tuple[torch.Tensor, torch.Tensor]


def _randn(shape: tuple[int, ...], gen: torch.Generator, gain: torch.Tensor | None, device: torch.device | str,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    x = torch.randn(*shape, generator=gen)
    return (x if gain is None else x * gain).to(device=device, dtype=dtype)


def fill_prefixes(kv: KVCache, rows: list[int], prefix_lens: list[int], gen: torch.Generator,
                  gains: Gains | None = None) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Allocate and write random K/V for each request's prefix, in every layer (times ``gains``, if given). Returns
    the slots and each layer's (k, v) as written (what an fp8 pool stores quantised)."""
    loc = kv.alloc_extend(rows, prefix_lens)
    pool = kv.pool
    k_gain, v_gain = gains or (None, None)
    written = []
    for layer_id in range(pool.num_layers):
        n = loc.shape[0]
        k = _randn((n, pool.num_kv_heads, pool.head_dim), gen, k_gain, pool.device)
        v = _randn((n, pool.num_kv_heads, pool.v_head_dim), gen, v_gain, pool.device)
        pool.set_kv(layer_id, loc, k, v)
        written.append((k, v))
    return loc, written


def random_step(
    kv: KVCache,
    prefix_lens: list[int],
    extend_lens: list[int],
    num_q_heads: int,
    gen: torch.Generator,
    dtype: torch.dtype | None = None,
    forward_mode: ForwardMode | None = None,
    shuffle_pages: bool = True,
    gains: Gains | None = None,
) -> RandomStep:
    """New requests with random cached prefixes, then a step adding ``extend_lens`` tokens to each. ``gains``
    scale the prefixes' and the step's K and V per KV head."""
    pool = kv.pool
    dtype = dtype or pool.dtype
    if shuffle_pages:  # scatter pages so requests do not occupy contiguous slots
        perm = torch.randperm(kv.allocator.available, generator=gen).tolist()
        free = kv.allocator._free
        kv.allocator._free = array.array("q", [free[i] for i in perm])
    rows = [kv.alloc_request() for _ in prefix_lens]
    prefix_loc, prefix_kv = fill_prefixes(kv, rows, list(prefix_lens), gen, gains)
    loc = kv.alloc_extend(rows, list(extend_lens))
    fb = ForwardBatch.build(
        req_pool_indices=rows, prefix_lens=prefix_lens, extend_lens=extend_lens, out_cache_loc=loc,
        forward_mode=forward_mode, device=pool.device,
    )
    t = sum(extend_lens)
    q = torch.randn(t, num_q_heads, pool.head_dim, generator=gen).to(device=pool.device, dtype=dtype)
    k_gain, v_gain = gains or (None, None)
    k = _randn((t, pool.num_kv_heads, pool.head_dim), gen, k_gain, pool.device, dtype)
    v = _randn((t, pool.num_kv_heads, pool.v_head_dim), gen, v_gain, pool.device, dtype)
    return RandomStep(fb, rows, list(prefix_lens), list(extend_lens), q, k, v, prefix_loc, prefix_kv)
