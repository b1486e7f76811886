"""The decode kernel's verify mode (``tokens_per_request`` Q > 1: a chain verify step's Q tokens per request in one
program per KV tile) against a float64 causal reference, against the same tokens run as Q decode rows each, and with
Q = 1 against plain decode, bit for bit.

The reference gathers each request's keys through ``req_to_token`` (never the CSR the kernel reads) and lets token t
of Q see the request's first ``length - Q + 1 + t`` of them.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.attention.kernels.kernel_reference import (
    DEVICE, TOLERANCE, PagedCache, make_paged_cache, reference_attention, rel_err)

from compile_attn.attention.kernels import compute_num_kv_splits, decode_attention_fwd, decode_semaphores
from compile_attn.attention.kernels.decode_attention import SPLIT_ALIGN, _launch_meta
from compile_attn.kv.fp8 import dequantize, fp8_max, quantize


def csr(cache: PagedCache) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_indptr / kv_indices of the requests' positions, built on the host (one spare index)."""
    slots = [cache.slots(b) for b in range(len(cache.lengths))]
    indptr = torch.tensor([0] + [len(s) for s in slots], device=DEVICE).cumsum(0).to(torch.int32)
    return indptr, torch.cat([*slots, torch.zeros(1, dtype=torch.long, device=DEVICE)]).to(torch.int32)


def run_attention(cache: PagedCache, q: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
                  num_kv_splits: torch.Tensor, max_kv_splits: int, tokens_per_request: int, *, one_launch: bool,
                  sm_scale: float, logit_cap: float = 0.0, kv: tuple | None = None, scales: dict | None = None,
                  ) -> torch.Tensor:
    """decode_attention_fwd into NaN-poisoned output and scratch (one row per query row); the one-launch merge's
    counters must be zero again afterwards."""
    rows, num_q_heads, _ = q.shape
    k_buffer, v_buffer = kv if kv is not None else (cache.k_buffer, cache.v_buffer)
    v_head_dim = v_buffer.shape[-1]
    out = torch.full((rows, num_q_heads, v_head_dim), float("nan"), dtype=q.dtype, device=DEVICE)
    logits = torch.full((rows, num_q_heads, max_kv_splits, v_head_dim), float("nan"), device=DEVICE)
    lse = torch.full((rows, num_q_heads, max_kv_splits), float("nan"), device=DEVICE)
    semaphores = decode_semaphores(rows, num_q_heads, DEVICE) if one_launch else None
    decode_attention_fwd(q, k_buffer, v_buffer, out, indptr, indices, num_kv_splits, max_kv_splits, logits, lse,
                         sm_scale, logit_cap, semaphores=semaphores, tokens_per_request=tokens_per_request,
                         **(scales or {}))
    if one_launch:
        assert not semaphores.any(), "the one-launch merge left a counter set"
    return out


def reference_verify(cache: PagedCache, q: torch.Tensor, tokens: int, sm_scale: float, logit_cap: float = 0.0,
                     kv: tuple | None = None) -> torch.Tensor:
    """float64: token t of request b (row b * tokens + t) over the request's first ``length - tokens + 1 + t``
    keys (none: zeros)."""
    keys, values = kv if kv is not None else (cache.k_buffer, cache.v_buffer)
    outs = []
    for b, length in enumerate(cache.lengths):
        slots = cache.slots(b)
        visible = length - tokens + 1 + torch.arange(tokens, device=DEVICE)
        allowed = torch.arange(length, device=DEVICE)[None, :] < visible[:, None]
        outs.append(reference_attention(q[b * tokens:(b + 1) * tokens], keys[slots], values[slots], allowed,
                                        sm_scale, logit_cap))
    return torch.cat(outs)


def unrolled(cache: PagedCache, tokens: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The same tokens as decode rows (what ``graph_runner/verify_unroll.py`` runs): row b * tokens + t reads
    request b's first ``length - tokens + 1 + t`` positions."""
    lens = [max(0, n - tokens + 1 + t) for n in cache.lengths for t in range(tokens)]
    rows = [b for b in range(len(cache.lengths)) for _ in range(tokens)]
    slots = [cache.slots(b, 0, n) for b, n in zip(rows, lens)]
    indptr = torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)
    return indptr, torch.cat([*slots, torch.zeros(1, dtype=torch.long, device=DEVICE)]).to(torch.int32), lens


def fp8_kv(cache: PagedCache, dtype: torch.dtype) -> tuple[tuple, dict, tuple]:
    """The cache quantised to ``dtype`` with per-head amax scales (heads scaled apart first, so their scales differ):
    (stored buffers, the scales as kwargs, the dequantised buffers)."""
    gain = torch.logspace(-1, 1, cache.k_buffer.shape[1], device=DEVICE)[None, :, None]
    k_real, v_real = cache.k_buffer.float() * gain, cache.v_buffer.float() / gain
    k_scale = (k_real.abs().amax(dim=(0, 2)) / fp8_max(dtype)).clamp_min(1e-6)
    v_scale = (v_real.abs().amax(dim=(0, 2)) / fp8_max(dtype)).clamp_min(1e-6)
    stored = (quantize(k_real, k_scale, dtype), quantize(v_real, v_scale, dtype))
    return stored, {"k_scale": k_scale, "v_scale": v_scale}, (dequantize(stored[0], k_scale),
                                                              dequantize(stored[1], v_scale))


@st.composite
def verify_cases(draw):
    tokens = draw(st.sampled_from([1, 2, 5]))
    bs = draw(st.integers(1, 3))
    # prefixes anywhere, or ending just before a split boundary so that the last split holds fewer than `tokens` keys
    # and the request's first tokens see none of it
    near_boundary = st.builds(lambda k, r: max(0, SPLIT_ALIGN * k + r - tokens), st.integers(1, 4),
                              st.integers(1, max(1, tokens - 1)))
    prefixes = draw(st.lists(st.one_of(st.integers(0, 300), near_boundary), min_size=bs, max_size=bs))
    return {
        "tokens": tokens,
        "lengths": [p + tokens for p in prefixes],
        "page_size": draw(st.sampled_from([1, 16])),
        "heads": draw(st.sampled_from([(2, 1), (1, 4), (2, 4), (1, 8)])),  # (num_kv_heads, group)
        "dtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "kv_fp8": draw(st.sampled_from([None, None, torch.float8_e4m3fn])),
        "logit_cap": draw(st.sampled_from([0.0, 0.0, 2.0])),
        "max_kv_splits": draw(st.sampled_from([1, 3, 8])),
        "splits": draw(st.sampled_from(["align", "random", "auto"])),
        "one_launch": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@settings(max_examples=30, deadline=None)
@given(case=verify_cases())
def test_verify_matches_causal_reference(case):
    gen = torch.Generator().manual_seed(case["seed"])
    tokens, lengths = case["tokens"], case["lengths"]
    num_kv_heads, group = case["heads"]
    bs, head_dim, max_kv_splits = len(lengths), 64, case["max_kv_splits"]
    cache = make_paged_cache(lengths, num_kv_heads, head_dim, head_dim, case["page_size"], case["dtype"], gen)
    q = (2 * torch.randn(bs * tokens, num_kv_heads * group, head_dim, generator=gen)).to(case["dtype"]).to(DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    if case["splits"] == "align":  # splits of SPLIT_ALIGN tokens: the last one short
        num_kv_splits = compute_num_kv_splits(lens, 1, max_kv_splits, deterministic=True, split_size=SPLIT_ALIGN)
    elif case["splits"] == "auto":
        num_kv_splits = compute_num_kv_splits(lens, 2, max_kv_splits, num_kv_heads=num_kv_heads)
    else:  # includes out-of-range counts (0, > max) that the kernels clamp
        num_kv_splits = torch.randint(0, max_kv_splits + 3, (bs,), generator=gen).int().to(DEVICE)
    kv = scales = None
    ref_kv = (cache.k_buffer, cache.v_buffer)
    if case["kv_fp8"] is not None:
        kv, scales, ref_kv = fp8_kv(cache, case["kv_fp8"])
    indptr, indices = csr(cache)
    out = run_attention(cache, q, indptr, indices, num_kv_splits, max_kv_splits, tokens,
                        one_launch=case["one_launch"], sm_scale=head_dim**-0.5, logit_cap=case["logit_cap"], kv=kv,
                        scales=scales)
    ref = reference_verify(cache, q, tokens, head_dim**-0.5, case["logit_cap"], kv=ref_kv)
    assert not out.isnan().any()
    assert rel_err(out, ref) <= TOLERANCE[case["dtype"]]


@pytest.mark.parametrize("one_launch", [False, True])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_verify_rows_without_keys_in_the_last_split(one_launch, group):
    """Splits of 64 keys with 1..4 keys in the last one: the first tokens of 5 see none of it (no NaN, the merge
    weighs it as empty); a request with fewer keys than tokens gives zeros to the rows that see none."""
    gen = torch.Generator().manual_seed(group)
    tokens = 5
    lengths = [2 * SPLIT_ALIGN + 1, SPLIT_ALIGN + 3, SPLIT_ALIGN + 4, 2, 0]
    cache = make_paged_cache(lengths, 2, 64, 64, 1, torch.float32, gen)
    q = torch.randn(len(lengths) * tokens, 2 * group, 64, generator=gen).to(DEVICE)
    splits = torch.tensor([3, 2, 2, 1, 1], dtype=torch.int32, device=DEVICE)
    indptr, indices = csr(cache)
    out = run_attention(cache, q, indptr, indices, splits, 4, tokens, one_launch=one_launch, sm_scale=0.125)
    assert not out.isnan().any()
    assert rel_err(out, reference_verify(cache, q, tokens, 0.125)) <= TOLERANCE[torch.float32]
    assert torch.equal(out[15:18], torch.zeros_like(out[15:18]))  # request 3: tokens 0..2 see no key
    assert torch.equal(out[20:], torch.zeros_like(out[20:]))  # request 4: no KV


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("one_launch", [False, True])
@pytest.mark.parametrize("group", [1, 4])
def test_verify_agrees_with_unrolled_decode_rows(kv_dtype, one_launch, group):
    """Q = 5 tokens per request in the verify mode give what the same tokens give as 5 decode rows each (seq_len
    prefix + 1 .. prefix + 5, how the graph runner verifies without it), to fp32 rounding."""
    gen = torch.Generator().manual_seed(7)
    tokens = 5
    lengths = [5, 70, 200]
    cache = make_paged_cache(lengths, 2, 64, 64, 16, torch.float32, gen)
    q = torch.randn(len(lengths) * tokens, 2 * group, 64, generator=gen).to(DEVICE)
    kv, scales = (None, None) if kv_dtype is None else fp8_kv(cache, kv_dtype)[:2]
    indptr, indices = csr(cache)
    splits = torch.tensor([1, 2, 3], dtype=torch.int32, device=DEVICE)
    verify = run_attention(cache, q, indptr, indices, splits, 4, tokens, one_launch=one_launch, sm_scale=0.125,
                           kv=kv, scales=scales)
    row_indptr, row_indices, row_lens = unrolled(cache, tokens)
    row_splits = splits.repeat_interleave(tokens)
    rows = run_attention(cache, q, row_indptr, row_indices, row_splits, 4, 1, one_launch=one_launch,
                         sm_scale=0.125, kv=kv, scales=scales)
    torch.testing.assert_close(verify, rows, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("group", [1, 4])
def test_one_token_per_request_is_decode(group):
    """tokens_per_request=1 is the decode launch: the same kernel arguments, bit-identical output, and group 1 keeps
    the non-dot path (one row per program)."""
    gen = torch.Generator().manual_seed(group)
    lengths = [1, 65, 130]
    cache = make_paged_cache(lengths, 2, 64, 64, 1, torch.bfloat16, gen)
    q = torch.randn(3, 2 * group, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    indptr, indices = csr(cache)
    splits = torch.tensor([1, 2, 3], dtype=torch.int32, device=DEVICE)
    out = torch.empty(3, 2 * group, 64, dtype=torch.bfloat16, device=DEVICE)
    logits, lse = torch.empty(3, 2 * group, 3, 64, device=DEVICE), torch.empty(3, 2 * group, 3, device=DEVICE)
    decode_attention_fwd(q, cache.k_buffer, cache.v_buffer, out, indptr, indices, splits, 3, logits, lse, 0.125)
    verify = run_attention(cache, q, indptr, indices, splits, 3, 1, one_launch=False, sm_scale=0.125)
    assert torch.equal(out, verify)
    _, split_meta, _ = _launch_meta(2 * group, 2, 64, 64, torch.bfloat16, 3, False, False, True, torch.bfloat16, 1)
    assert split_meta["USE_DOT"] is (group > 1) and split_meta["BLOCK_H"] == (16 if group > 1 else 1)
    _, split_meta, _ = _launch_meta(2 * group, 2, 64, 64, torch.bfloat16, 3, False, False, True, torch.bfloat16, 5)
    assert split_meta["USE_DOT"] and split_meta["BLOCK_H"] == (16 if group == 1 else 32)


@pytest.mark.parametrize(
    "tokens,group,kwargs,match",
    [
        (5, 4, {"k_new": True}, "store them first"),
        (5, 4, {"new_loc": True}, "store them first"),
        (5, 16, {}, r"tokens_per_request 5 x GQA group 16 = 80"),
        (3, 4, {"rows": 10}, "not a multiple of tokens_per_request 3"),
        (0, 4, {}, "must be >= 1"),
        (5, 4, {"semaphore_rows": 2}, r"\(>= 10, >= 8\)"),
    ],
)
def test_verify_names_bad_arguments(tokens, group, kwargs, match):
    gen = torch.Generator().manual_seed(11)
    cache = make_paged_cache([7, 9], 2, 64, 64, 1, torch.float32, gen)
    rows = kwargs.get("rows", 2 * max(tokens, 1))
    q = torch.randn(rows, 2 * group, 64, generator=gen).to(DEVICE)
    out = torch.empty_like(q)
    logits, lse = torch.empty(rows, 2 * group, 2, 64, device=DEVICE), torch.empty(rows, 2 * group, 2, device=DEVICE)
    indptr, indices = csr(cache)
    extra = {}
    if kwargs.get("k_new"):
        extra.update(k_new=torch.zeros(2, 2, 64, device=DEVICE), v_new=torch.zeros(2, 2, 64, device=DEVICE))
    if kwargs.get("new_loc"):
        extra.update(new_loc=torch.zeros(2, dtype=torch.int64, device=DEVICE))
    if "semaphore_rows" in kwargs:
        extra.update(semaphores=decode_semaphores(kwargs["semaphore_rows"], 2 * group, DEVICE))
    with pytest.raises(ValueError, match=match):
        decode_attention_fwd(q, cache.k_buffer, cache.v_buffer, out, indptr, indices,
                             torch.ones(2, dtype=torch.int32, device=DEVICE), 2, logits, lse, 0.125,
                             tokens_per_request=tokens, **extra)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the serving-size case)")
@pytest.mark.parametrize("one_launch", [False, True])
def test_verify_serving_size_gpu(one_launch):
    """64 requests x 5 tokens over 512-token prefixes, 32 q / 8 KV heads, head dim 64, bf16, shuffled slots, the
    backend's split heuristic: against the reference and against the unrolled decode rows."""
    gen = torch.Generator().manual_seed(0)
    tokens, bs, prefix = 5, 64, 512
    lengths = [prefix + tokens] * bs
    cache = make_paged_cache(lengths, 8, 64, 64, 1, torch.bfloat16, gen)
    q = torch.randn(bs * tokens, 32, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    splits = compute_num_kv_splits(lens, num_sms, 16, num_kv_heads=8)
    indptr, indices = csr(cache)
    sm_scale = 1 / math.sqrt(64)
    out = run_attention(cache, q, indptr, indices, splits, 16, tokens, one_launch=one_launch, sm_scale=sm_scale)
    assert not out.isnan().any()
    assert rel_err(out, reference_verify(cache, q, tokens, sm_scale)) <= TOLERANCE[torch.bfloat16]
    row_indptr, row_indices, row_lens = unrolled(cache, tokens)
    row_splits = compute_num_kv_splits(torch.tensor(row_lens, dtype=torch.int32, device=DEVICE), num_sms, 16,
                                       num_kv_heads=8)
    rows = run_attention(cache, q, row_indptr, row_indices, row_splits, 16, 1, one_launch=one_launch,
                         sm_scale=sm_scale)
    assert rel_err(out, rows) <= TOLERANCE[torch.bfloat16]
