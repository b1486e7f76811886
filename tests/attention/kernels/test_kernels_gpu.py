"""GPU-only kernel tests: long contexts in bf16, CUDA-graph capture/replay of decode, and the
batch-invariance of deterministic decode. Skipped without CUDA."""

from __future__ import annotations

import math

import pytest
import torch
from tests.attention.kernels.kernel_reference import TOLERANCE, PagedCache, make_paged_cache, reference_attention, rel_err, take_new_tokens

from compile_attn.attention.kernels import (
    build_kv_indices,
    build_kv_indptr,
    compute_num_kv_splits,
    decode_attention_fwd,
    decode_semaphores,
    extend_attention_fwd,
)
from compile_attn.attention.kernels import decode_attention as decode_module

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_KV_SPLITS = 16


def num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def reference_decode(cache, q, sm_scale, logit_cap=0.0):
    outs = []
    for b in range(q.shape[0]):
        slots = cache.slots(b)
        allowed = torch.ones(1, len(slots), dtype=torch.bool, device="cuda")
        outs.append(
            reference_attention(
                q[b : b + 1], cache.k_buffer[slots], cache.v_buffer[slots], allowed, sm_scale, logit_cap
            )
        )
    return torch.cat(outs)


def decode(cache, q, seq_lens, deterministic=False, logit_cap=0.0, new_tokens=None, one_launch=False):
    """Device-built metadata (build_kv_indptr/indices, compute_num_kv_splits), then decode; ``new_tokens``:
    (k_new, v_new, new_loc) for the fused K/V store; ``one_launch``: the merge inside the split kernel."""
    bs, num_q_heads, head_dim = q.shape
    v_head_dim = cache.v_buffer.shape[-1]
    indptr = torch.empty(bs + 1, dtype=torch.int32, device="cuda")
    build_kv_indptr(seq_lens, indptr)
    indices = torch.empty(int(seq_lens.sum()), dtype=torch.int32, device="cuda")
    build_kv_indices(cache.req_to_token, cache.rows, seq_lens, indptr, indices)
    splits = compute_num_kv_splits(
        seq_lens,
        num_sms(),
        MAX_KV_SPLITS,
        deterministic,
        split_size=256,
        num_kv_heads=cache.k_buffer.shape[1],
    )
    out = torch.full((bs, num_q_heads, v_head_dim), float("nan"), dtype=q.dtype, device="cuda")
    logits = torch.full((bs, num_q_heads, MAX_KV_SPLITS, v_head_dim), float("nan"), device="cuda")
    lse = torch.full((bs, num_q_heads, MAX_KV_SPLITS), float("nan"), device="cuda")
    semaphores = decode_semaphores(bs, num_q_heads, "cuda") if one_launch else None
    decode_attention_fwd(
        q,
        cache.k_buffer,
        cache.v_buffer,
        out,
        indptr,
        indices,
        splits,
        MAX_KV_SPLITS,
        logits,
        lse,
        1 / math.sqrt(head_dim),
        logit_cap,
        **({} if new_tokens is None else dict(zip(("k_new", "v_new", "new_loc"), new_tokens))),
        semaphores=semaphores,
        batch_invariant=deterministic,
    )
    if one_launch:
        assert not semaphores.any()
    return out


@pytest.mark.parametrize("one_launch", [False, True])
@pytest.mark.parametrize("num_kv_heads,num_q_heads", [(8, 32), (1, 128)])  # group 128: two head blocks per KV head
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_fused_store_long_context_bf16(num_kv_heads, num_q_heads, head_dim, one_launch):
    """The fused K/V store: new tokens from k_new/v_new (their cache slots hold NaN until stored), against the
    reference over the restored cache, with the cache restored bit for bit."""
    gen = torch.Generator().manual_seed(head_dim + num_q_heads)
    lengths = [1, 0, 4096, *torch.randint(1, 4097, (9,), generator=gen).tolist()]
    cache = make_paged_cache(lengths, num_kv_heads, head_dim, head_dim, 16, torch.bfloat16, gen, device="cuda")
    q = torch.randn(len(lengths), num_q_heads, head_dim, generator=gen).to(torch.bfloat16).cuda()
    *new_tokens, original = take_new_tokens(cache, len(lengths), gen, device="cuda")
    out = decode(cache, q, torch.tensor(lengths, dtype=torch.int32, device="cuda"), new_tokens=new_tokens,
                 one_launch=one_launch)
    assert torch.equal(cache.k_buffer, original[0]) and torch.equal(cache.v_buffer, original[1])
    ref = reference_decode(cache, q, 1 / math.sqrt(head_dim))
    assert not out.isnan().any()
    assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("head_dim,v_head_dim", [(64, 64), (128, 128), (256, 256), (192, 128)])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("logit_cap", [0.0, 30.0])
@pytest.mark.parametrize("one_launch", [False, True])
def test_decode_long_context_bf16(head_dim, v_head_dim, page_size, logit_cap, one_launch):
    gen = torch.Generator().manual_seed(head_dim + page_size)
    lengths = [1, 8192, *torch.randint(1, 8193, (10,), generator=gen).tolist()]
    cache = make_paged_cache(lengths, 8, head_dim, v_head_dim, page_size, torch.bfloat16, gen, device="cuda")
    q = torch.randn(len(lengths), 32, head_dim, generator=gen).to(torch.bfloat16).cuda()
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out = decode(cache, q, seq_lens, logit_cap=logit_cap, one_launch=one_launch)
    ref = reference_decode(cache, q, 1 / math.sqrt(head_dim), logit_cap)
    assert not out.isnan().any()
    assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("one_launch", [False, True])
def test_decode_small_batch_tiles_and_large_batch_tiles(one_launch):
    """Head dim 64 decodes with larger KV tiles at up to SMALL_BATCH requests than above it: the same requests
    alone and inside a batch of SMALL_BATCH + 8 both match the float64 reference."""
    gen = torch.Generator().manual_seed(5)
    bs = decode_module.SMALL_BATCH + 8
    lengths = [1, 63, 64, 65, 700, *torch.randint(1, 3000, (bs - 5,), generator=gen).tolist()]
    cache = make_paged_cache(lengths, 8, 64, 64, 16, torch.bfloat16, gen, device="cuda")
    q = torch.randn(bs, 32, 64, generator=gen).to(torch.bfloat16).cuda()
    ref = reference_decode(cache, q, 1 / 8)
    whole = decode(cache, q, torch.tensor(lengths, dtype=torch.int32, device="cuda"), one_launch=one_launch)
    assert rel_err(whole, ref) <= TOLERANCE[torch.bfloat16]
    members = [0, 1, 2, 3, 4]
    part = decode(make_sub_batch(cache, members), q[members],
                  torch.tensor(lengths[:5], dtype=torch.int32, device="cuda"), one_launch=one_launch)
    assert rel_err(part, ref[members]) <= TOLERANCE[torch.bfloat16]


def test_decode_one_launch_merge_has_no_race():
    """Many requests with 16 splits each, partials poisoned with NaN before every launch: a merge that read a
    partial before its program had written it would give NaN or a different answer. 30 launches, all identical
    and matching the reference."""
    gen = torch.Generator().manual_seed(11)
    bs, hq, hkv, d = 96, 32, 8, 64
    lengths = torch.randint(1024, 4097, (bs,), generator=gen).tolist()
    cache = make_paged_cache(lengths, hkv, d, d, 1, torch.bfloat16, gen, device="cuda")
    q = torch.randn(bs, hq, d, generator=gen).to(torch.bfloat16).cuda()
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    indptr = torch.empty(bs + 1, dtype=torch.int32, device="cuda")
    build_kv_indptr(seq_lens, indptr)
    indices = torch.empty(int(seq_lens.sum()), dtype=torch.int32, device="cuda")
    build_kv_indices(cache.req_to_token, cache.rows, seq_lens, indptr, indices)
    splits = torch.full((bs,), MAX_KV_SPLITS, dtype=torch.int32, device="cuda")
    logits = torch.empty(bs, hq, MAX_KV_SPLITS, d, device="cuda")
    lse = torch.empty(bs, hq, MAX_KV_SPLITS, device="cuda")
    semaphores = decode_semaphores(bs, hq, "cuda")
    outs = []
    for _ in range(30):
        logits.fill_(float("nan"))
        lse.fill_(float("nan"))
        out = torch.full((bs, hq, d), float("nan"), dtype=torch.bfloat16, device="cuda")
        decode_attention_fwd(q, cache.k_buffer, cache.v_buffer, out, indptr, indices, splits, MAX_KV_SPLITS, logits,
                             lse, 1 / math.sqrt(d), semaphores=semaphores)
        outs.append(out)
    assert not semaphores.any()
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert rel_err(outs[0], reference_decode(cache, q, 1 / math.sqrt(d))) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("sliding_window,logit_cap", [(-1, 0.0), (700, 0.0), (-1, 30.0)])
def test_extend_long_prefix_bf16(head_dim, sliding_window, logit_cap):
    gen = torch.Generator().manual_seed(head_dim)
    prefix, extend = [0, 3000, 517, 2048], [1024, 1, 777, 300]
    num_kv_heads, num_q_heads = 8, 32
    cache = make_paged_cache(
        [p + e for p, e in zip(prefix, extend)],
        num_kv_heads,
        head_dim,
        head_dim,
        16,
        torch.bfloat16,
        gen,
        device="cuda",
    )
    total = sum(extend)
    q = torch.randn(total, num_q_heads, head_dim, generator=gen).to(torch.bfloat16).cuda()
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(torch.bfloat16).cuda()
    qo_indptr = torch.tensor([0, *extend]).cumsum(0).int().cuda()
    kv_indptr = torch.tensor([0, *prefix]).cumsum(0).int().cuda()
    kv_indices = torch.cat([cache.slots(b, 0, p) for b, p in enumerate(prefix)]).int()
    out = torch.full((total, num_q_heads, head_dim), float("nan"), dtype=torch.bfloat16, device="cuda")
    sm_scale = 1 / math.sqrt(head_dim)
    extend_attention_fwd(
        q,
        k,
        v,
        out,
        cache.k_buffer,
        cache.v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        max(extend),
        sm_scale,
        sliding_window=sliding_window,
        logit_cap=logit_cap,
    )
    assert not out.isnan().any()
    q_lo = 0
    for b, (p, e) in enumerate(zip(prefix, extend)):
        slots = cache.slots(b, 0, p)
        keys = torch.cat([cache.k_buffer[slots], k[q_lo : q_lo + e]])
        values = torch.cat([cache.v_buffer[slots], v[q_lo : q_lo + e]])
        q_pos = torch.arange(p, p + e, device="cuda")[:, None]
        k_pos = torch.arange(p + e, device="cuda")[None, :]
        allowed = k_pos <= q_pos
        if sliding_window > 0:
            allowed &= k_pos > q_pos - sliding_window
        ref = reference_attention(q[q_lo : q_lo + e], keys, values, allowed, sm_scale, logit_cap)
        assert rel_err(out[q_lo : q_lo + e], ref) <= TOLERANCE[torch.bfloat16], b
        q_lo += e


@pytest.mark.parametrize("one_launch", [False, True])
def test_decode_cuda_graph_replay_with_new_metadata(one_launch):
    """Capture metadata building + decode once; replay after rewriting every index buffer's contents."""
    max_bs, max_context, head_dim = 8, 3000, 128
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(1, max_context, (max_bs,), generator=gen).tolist() for _ in range(3)]
    batches[1][3] = 1  # a padded-style request
    # One cache whose table rows serve every batch: make_paged_cache with the largest lengths.
    cache = make_paged_cache(
        [max_context] * max_bs, 8, head_dim, head_dim, 16, torch.bfloat16, gen, device="cuda"
    )
    table = cache.req_to_token.clone()

    seq_lens = torch.zeros(max_bs, dtype=torch.int32, device="cuda")
    req_pool_indices = cache.rows.clone()
    indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device="cuda")
    indices = torch.zeros(max_bs * max_context, dtype=torch.int32, device="cuda")
    splits = torch.zeros(max_bs, dtype=torch.int32, device="cuda")
    q = torch.zeros(max_bs, 32, head_dim, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(max_bs, 32, head_dim, dtype=torch.bfloat16, device="cuda")
    logits = torch.empty(max_bs, 32, MAX_KV_SPLITS, head_dim, device="cuda")
    lse = torch.empty(max_bs, 32, MAX_KV_SPLITS, device="cuda")
    semaphores = decode_semaphores(max_bs, 32, "cuda") if one_launch else None

    def step():
        build_kv_indptr(seq_lens, indptr)
        build_kv_indices(cache.req_to_token, req_pool_indices, seq_lens, indptr, indices)
        compute_num_kv_splits(seq_lens, num_sms(), MAX_KV_SPLITS, num_kv_heads=8, out=splits)
        decode_attention_fwd(
            q,
            cache.k_buffer,
            cache.v_buffer,
            out,
            indptr,
            indices,
            splits,
            MAX_KV_SPLITS,
            logits,
            lse,
            1 / math.sqrt(head_dim),
            semaphores=semaphores,
        )

    def load(lengths, seed):
        """New contents for every static input: rows, their table entries, lengths, queries."""
        g = torch.Generator().manual_seed(seed)
        req_pool_indices.copy_(cache.rows[torch.randperm(max_bs, generator=g)])
        rows = cache.rows.long()
        cache.req_to_token[rows] = table[rows[torch.randperm(max_bs, generator=g)]]
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=g).to(torch.bfloat16))

    load(batches[0], 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for i, lengths in enumerate(batches):
        load(lengths, 100 + i)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for b in range(max_bs):
            slots = cache.req_to_token[int(req_pool_indices[b]), : lengths[b]].long()
            allowed = torch.ones(1, lengths[b], dtype=torch.bool, device="cuda")
            ref = reference_attention(
                q[b : b + 1], cache.k_buffer[slots], cache.v_buffer[slots], allowed, 1 / math.sqrt(head_dim)
            )
            assert rel_err(out[b : b + 1], ref) <= TOLERANCE[torch.bfloat16], (i, b)


@pytest.mark.parametrize("one_launch", [False, True])
def test_deterministic_decode_is_batch_invariant(one_launch):
    """The same request gives identical bits alone, at another batch position, and among others."""
    gen = torch.Generator().manual_seed(11)
    target_len, head_dim = 3001, 128
    others = torch.randint(1, 6000, (40,), generator=gen).tolist()
    cache = make_paged_cache(
        [target_len, *others], 8, head_dim, head_dim, 1, torch.bfloat16, gen, device="cuda"
    )
    q_all = torch.randn(1 + len(others), 32, head_dim, generator=gen).to(torch.bfloat16).cuda()
    results = []
    for members in ([0], [0, 1, 2], [5, 0], [*range(1, 30), 0, *range(30, 41)]):
        sub = make_sub_batch(cache, members)
        seq_lens = torch.tensor(sub.lengths, dtype=torch.int32, device="cuda")
        out = decode(sub, q_all[members], seq_lens, deterministic=True, one_launch=one_launch)
        results.append(out[members.index(0)])
    for other in results[1:]:
        assert torch.equal(other, results[0])
    # and the bits it keeps are right: request 0 against the float64 reference over its gathered KV
    slots = cache.slots(0)
    allowed = torch.ones(1, target_len, dtype=torch.bool, device="cuda")
    ref = reference_attention(q_all[:1], cache.k_buffer[slots], cache.v_buffer[slots], allowed, 1 / math.sqrt(head_dim))
    assert rel_err(results[0][None], ref) <= TOLERANCE[torch.bfloat16]


def make_sub_batch(cache, members):
    """The requests ``members`` of ``cache`` as their own batch (same buffers and table)."""
    return PagedCache(
        cache.k_buffer,
        cache.v_buffer,
        cache.req_to_token,
        cache.rows[members],
        [cache.lengths[m] for m in members],
    )
