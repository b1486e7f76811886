"""The triton backend's shared-prefix (cascade) decode on a KV cache whose rows borrow prefix pages from the prefix
cache: the groups it finds, the path it takes, and its outputs against the torch_native backend (plain attention
over each request's whole sequence)."""

from __future__ import annotations

import array

import pytest
import torch

from compile_attn import ForwardBatch, KVCache
from compile_attn.attention.torch_native.backend import TorchNativeBackend
from compile_attn.attention.triton.backend import TritonBackend
from compile_attn.layer import AttentionLayer
from compile_attn.batch import SharedPrefixGroup
from compile_attn.kv.shared_prefix import SharedPrefixFinder, find_shared_prefixes

HQ, HKV, D = 4, 2, 64


def shared_cache(page_size: int, prefix: int, own: list[int], gen: torch.Generator, device: str = "cpu",
                 dtype: torch.dtype = torch.float32):
    """Row 0 computes ``prefix + own[0]`` tokens and caches them; rows 1.. match the prefix from the tree and add
    their own tokens; one more row shares nothing. Returns the cache, the rows, their lengths and the tokens each
    borrowed from the tree."""
    kv = KVCache(num_layers=2, num_kv_heads=HKV, head_dim=D, max_batch_size=len(own) + 2, max_context=prefix + 64,
                 kv_cache_tokens=(len(own) + 2) * (prefix + 64), page_size=page_size, dtype=dtype, device=device)
    kv.enable_prefix_cache()
    cache = kv.prefix_cache
    tokens = array.array("q", range(1000, 1000 + prefix))
    rows, lens, borrowed = [], [], []
    for i, n in enumerate(own):
        row = kv.alloc_request()
        mine = tokens + array.array("q", [7 + i] * n)
        start = 0
        if i:
            start = cache.attach(row, cache.match(mine, len(mine) - 1), len(mine))
        kv.alloc_extend([row], [len(mine) - start])
        if i == 0:
            cache.insert(row, mine)
        rows.append(row)
        lens.append(len(mine))
        borrowed.append(start)
    lone = kv.alloc_request()
    kv.alloc_extend([lone], [prefix // 2 + 3])
    rows.append(lone)
    lens.append(prefix // 2 + 3)
    for k_buf, v_buf in zip(kv.pool.k_buffers, kv.pool.v_buffers):
        k_buf.copy_(torch.randn(k_buf.shape, generator=gen).to(dtype))
        v_buf.copy_(torch.randn(v_buf.shape, generator=gen).to(dtype))
    return kv, rows, lens, borrowed


def decode_step(kv: KVCache, rows: list[int], lens: list[int]) -> ForwardBatch:
    loc = kv.alloc_extend(rows, [1] * len(rows))
    return ForwardBatch.build(req_pool_indices=rows, prefix_lens=lens, extend_lens=[1] * len(rows), out_cache_loc=loc,
                              device=kv.device)


@pytest.mark.parametrize("page_size,prefix", [(1, 45), (4, 50)])
def test_cascade_decode_matches_torch_native(page_size, prefix):
    gen = torch.Generator().manual_seed(page_size)
    own = [3, 1, 6, 2]
    kv, rows, lens, borrowed = shared_cache(page_size, prefix, own, gen)
    shared = prefix // page_size * page_size  # the tree holds whole pages only
    assert borrowed[1:] == [shared] * 3
    layers = [AttentionLayer(layer_id=i, num_heads=HQ, num_kv_heads=HKV, head_dim=D) for i in range(2)]
    backend = TritonBackend(kv, layers)
    reference = TorchNativeBackend(kv, layers)
    fb = decode_step(kv, rows, lens)
    n = len(rows)
    backend.init_forward_metadata(fb)
    assert backend.cascade.steps == 0  # a batch without groups: the plain decode kernel
    fb.shared_prefix = SharedPrefixFinder(kv, min_requests=2, min_tokens=8).groups_for(fb)
    assert fb.shared_prefix == find_shared_prefixes(kv, rows, [x + 1 for x in lens], min_requests=2, min_tokens=8) == (
        SharedPrefixGroup((0, 1, 2, 3), shared),)
    backend.init_forward_metadata(fb)
    assert backend.cascade.steps == 1
    for layer in layers:
        q = torch.randn(n, HQ, D, generator=gen)
        k, v = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
        out, ref = torch.full((n, HQ, D), float("nan")), torch.empty(n, HQ, D)
        backend.forward(q, k, v, layer, fb, out)
        reference.init_forward_metadata(fb)
        reference.forward(q, k, v, layer, fb, ref)  # stores the same new K/V again, then attends
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_groups_carried_by_the_batch_are_used_and_small_groups_are_not_found():
    gen = torch.Generator().manual_seed(3)
    kv, rows, lens, _ = shared_cache(1, 40, [2, 2, 2], gen)
    layers = [AttentionLayer(layer_id=0, num_heads=HQ, num_kv_heads=HKV, head_dim=D)]
    backend = TritonBackend(kv, layers)
    fb = decode_step(kv, rows, lens)
    fb.shared_prefix = SharedPrefixFinder(kv).groups_for(fb)  # default thresholds: 3 requests sharing 40 tokens
    assert fb.shared_prefix == ()
    backend.init_forward_metadata(fb)
    assert backend.cascade.steps == 0  # too small a group to find: the plain decode kernel
    fb.shared_prefix = (SharedPrefixGroup((2, 0), 17),)  # any shared positions work, even mid-page
    backend.init_forward_metadata(fb)
    assert backend.cascade.steps == 1
    n = len(rows)
    q = torch.randn(n, HQ, D, generator=gen)
    k, v = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
    out, ref = torch.empty(n, HQ, D), torch.empty(n, HQ, D)
    backend.forward(q, k, v, layers[0], fb, out)
    reference = TorchNativeBackend(kv, layers)
    reference.init_forward_metadata(fb)
    reference.forward(q, k, v, layers[0], fb, ref)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
