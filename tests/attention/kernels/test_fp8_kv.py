"""The Triton kernels over an fp8 KV cache (per-head float32 scales, stored = real / scale): the stores against
``kv/fp8.quantize`` bit for bit, and decode, extend (causal, window, softcap, custom and tree masks) and cascade
against the float64 reference over the dequantised cache (tight: the kernels' own error) and over the original
values (the quantisation error, bounded).

The bounds on the quantisation error are for these tests' data (unit-variance random K/V, scales at amax / fp8 max,
so nothing saturates): the output's max error relative to its largest value. e4m3 keeps 3 mantissa bits (relative
rounding error <= 1/16 per element), e5m2 2 bits (<= 1/8); an attention output averages many values, so its error is
well below the per-element bound.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.attention.kernels.kernel_reference import (
    DEVICE,
    TOLERANCE,
    csr_from_lengths,
    make_paged_cache,
    reference_attention,
    reference_decode,
    rel_err,
)

from compile_attn.attention.kernels import (
    compute_num_kv_splits,
    decode_attention_fwd,
    decode_semaphores,
    extend_attention_fwd,
    store_kv,
)
from compile_attn.attention.kernels.cascade_attention import cascade_decode_fwd
from compile_attn.attention.kernels.cascade_index import build_cascade_index
from compile_attn.kv.fp8 import dequantize, fp8_max, quantize

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# max |out - ref(original KV)| / max |ref| on unit-variance data with amax scales (see the module docstring)
QUANT_ERROR = {torch.float8_e4m3fn: 0.08, torch.float8_e5m2: 0.16}


def amax_scales(x: torch.Tensor, dtype: torch.dtype, spread: float = 1.0) -> torch.Tensor:
    """Per-head scales that map each head's largest magnitude onto the format's largest value (times ``spread``:
    > 1 leaves headroom, < 1 saturates the largest values)."""
    return (x.float().abs().amax(dim=(0, 2)).clamp_min(1e-6) * spread / fp8_max(dtype)).to(DEVICE)


class Fp8Cache:
    """A paged cache (``make_paged_cache``) whose K/V are quantised into ``dtype`` with per-head scales; keeps the
    original values (``real``: ``k_real``/``v_real``) and the dequantised ones (``deq``) for the references.
    KV head h's values are multiplied by ``head_gain[h]`` first, so the heads' scales differ."""

    def __init__(self, lengths: list[int], num_kv_heads: int, head_dim: int, v_head_dim: int, page_size: int,
                 dtype: torch.dtype, gen: torch.Generator) -> None:
        base = make_paged_cache(lengths, num_kv_heads, head_dim, v_head_dim, page_size, torch.float32, gen)
        gain = torch.logspace(-1, 1, num_kv_heads, device=DEVICE)[None, :, None]
        self.k_real, self.v_real = base.k_buffer * gain, base.v_buffer / gain
        self.k_scale, self.v_scale = amax_scales(self.k_real, dtype), amax_scales(self.v_real, dtype)
        self.k_buffer = quantize(self.k_real, self.k_scale, dtype)
        self.v_buffer = quantize(self.v_real, self.v_scale, dtype)
        self.req_to_token, self.rows, self.lengths = base.req_to_token, base.rows, base.lengths
        self.slots = base.slots
        self.dtype = dtype

    @property
    def deq(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) as the kernels read them: the stored bytes dequantised."""
        return dequantize(self.k_buffer, self.k_scale), dequantize(self.v_buffer, self.v_scale)

    @property
    def real(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) before quantising."""
        return self.k_real, self.v_real

    @property
    def scales(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


class _Bits:
    """The outcome of a byte comparison: truthy when equal, with what differs in its repr (for assert messages)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        diff = a.view(torch.uint8) != b.view(torch.uint8)
        self.ok = not bool(diff.any())
        self.detail = "" if self.ok else (
            f"{int(diff.sum())} of {diff.numel()} bytes differ; first values {a[diff][:4].float().tolist()} "
            f"vs {b[diff][:4].float().tolist()}")

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"same_bits({self.ok}: {self.detail})"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> _Bits:
    return _Bits(a, b)


# ---------------------------------------------------------------------------------------------- stores
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("num_kv_heads", [1, 3, 8])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_quantises_as_kv_fp8(dtype: torch.dtype, num_kv_heads: int, src_dtype: torch.dtype) -> None:
    """Every stored byte equals ``kv/fp8.quantize``'s: round to nearest even, saturate (values 100x the scale's
    range), the signs of zeros, fp8 subnormals (values near the scale * 2^-9); other slots untouched."""
    gen = torch.Generator().manual_seed(num_kv_heads)
    t, d = 37, 64
    k = (torch.randn(t, num_kv_heads, d, generator=gen) * torch.logspace(-4, 2, t)[:, None, None]).to(src_dtype)
    v = (torch.randn(t, num_kv_heads, d, generator=gen) * 3).to(src_dtype)
    k[0, :, :4] = torch.tensor([0.0, -0.0, 1e9, -1e9]).to(src_dtype)
    k_scale = amax_scales(k, dtype, spread=0.01)  # the largest values saturate
    v_scale = amax_scales(v, dtype, spread=1.5)
    k, v = k.to(DEVICE), v.to(DEVICE)
    k_buf = torch.full((64, num_kv_heads, d), 7.0, device=DEVICE).to(dtype)
    v_buf = k_buf.clone()
    loc = torch.randperm(63, generator=gen)[:t].to(DEVICE) + 1
    store_kv(k_buf, v_buf, loc, k, v, k_scale=k_scale, v_scale=v_scale)
    assert same_bits(k_buf[loc], quantize(k, k_scale, dtype))
    assert same_bits(v_buf[loc], quantize(v, v_scale, dtype))
    assert k_buf.float().isfinite().all()
    others = torch.ones(64, dtype=torch.bool, device=DEVICE)
    others[loc] = False
    assert (k_buf[others].float() == 7.0).all() and (v_buf[others].float() == 7.0).all()


@pytest.mark.parametrize("dtype", FP8)
def test_decode_fused_store_quantises_as_kv_fp8(dtype: torch.dtype) -> None:
    """The decode kernel's fused store writes ``quantize(k_new)`` bit for bit, and attends to it as stored."""
    gen = torch.Generator().manual_seed(2)
    lengths = [1, 70, 130]
    cache = Fp8Cache(lengths, 2, 64, 64, 16, dtype, gen)
    bs = len(lengths)
    k_new = (torch.randn(bs, 2, 64, generator=gen) * 2).to(DEVICE)
    v_new = (torch.randn(bs, 2, 64, generator=gen) * 2).to(DEVICE)
    new_loc = torch.stack([cache.slots(b)[-1] for b in range(bs)])
    cache.k_buffer.view(torch.uint8)[new_loc] = 0x7F  # NaN in both formats: read instead of k_new, NaN out
    q = torch.randn(bs, 8, 64, generator=gen).to(DEVICE)
    out = run_decode(cache, q, [0] * bs, torch.tensor([1, 2, 3], dtype=torch.int32, device=DEVICE), 3, 0.125,
                     new_tokens=(k_new, v_new, new_loc), one_launch=True)
    assert same_bits(cache.k_buffer[new_loc], quantize(k_new, cache.k_scale, dtype))
    assert same_bits(cache.v_buffer[new_loc], quantize(v_new, cache.v_scale, dtype))
    assert rel_err(out, reference_decode(cache, q, [0] * bs, 0.125, kv=cache.deq)) <= TOLERANCE[torch.float32]


# ---------------------------------------------------------------------------------------------- decode
def run_decode(cache: Fp8Cache, q, starts, num_kv_splits, max_kv_splits, sm_scale, logit_cap=0.0, new_tokens=None,
               one_launch=False) -> torch.Tensor:
    bs, num_q_heads, _ = q.shape
    slots = [cache.slots(b, starts[b]) for b in range(bs)]
    indptr = torch.tensor([0] + [len(s) for s in slots], device=DEVICE).cumsum(0).to(torch.int32)
    indices = torch.cat([*slots, torch.zeros(1, dtype=torch.long, device=DEVICE)]).to(torch.int32)
    out = torch.full((bs, num_q_heads, cache.v_buffer.shape[-1]), float("nan"), dtype=q.dtype, device=DEVICE)
    logits = torch.full((bs, num_q_heads, max_kv_splits, cache.v_buffer.shape[-1]), float("nan"), device=DEVICE)
    lse = torch.full((bs, num_q_heads, max_kv_splits), float("nan"), device=DEVICE)
    semaphores = decode_semaphores(bs, num_q_heads, DEVICE) if one_launch else None
    new = {} if new_tokens is None else dict(zip(("k_new", "v_new", "new_loc"), new_tokens))
    decode_attention_fwd(q, cache.k_buffer, cache.v_buffer, out, indptr, indices, num_kv_splits, max_kv_splits,
                         logits, lse, sm_scale, logit_cap, semaphores=semaphores, **new, **cache.scales)
    if one_launch:
        assert not semaphores.any()
    return out


@st.composite
def decode_cases(draw):
    bs = draw(st.integers(1, 3))
    return {
        "lengths": draw(st.lists(st.integers(1, 200), min_size=bs, max_size=bs)),
        "page_size": draw(st.sampled_from([1, 16])),
        "heads": draw(st.sampled_from([(1, 1), (2, 1), (2, 4), (1, 8)])),  # (KV heads, group): GQA 1/4/8
        "kv_dtype": draw(st.sampled_from(FP8)),
        "q_dtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "window": draw(st.sampled_from([-1, -1, 50])),
        "logit_cap": draw(st.sampled_from([0.0, 0.0, 2.0])),
        "max_kv_splits": draw(st.sampled_from([1, 3])),
        "one_launch": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@settings(max_examples=12, deadline=None)
@given(case=decode_cases())
def test_decode_over_fp8_matches_reference(case: dict) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    lengths, bs = case["lengths"], len(case["lengths"])
    num_kv_heads, group = case["heads"]
    cache = Fp8Cache(lengths, num_kv_heads, 64, 64, case["page_size"], case["kv_dtype"], gen)
    window = case["window"]
    starts = [max(0, n - window) if window > 0 else 0 for n in lengths]
    q = (2 * torch.randn(bs, num_kv_heads * group, 64, generator=gen)).to(case["q_dtype"]).to(DEVICE)
    kv_lens = torch.tensor([n - s for n, s in zip(lengths, starts)], dtype=torch.int32, device=DEVICE)
    splits = compute_num_kv_splits(kv_lens, 2, case["max_kv_splits"], num_kv_heads=num_kv_heads, split_size=64)
    out = run_decode(cache, q, starts, splits, case["max_kv_splits"], 0.125, case["logit_cap"],
                     one_launch=case["one_launch"])
    assert not out.isnan().any()
    exact = reference_decode(cache, q, starts, 0.125, case["logit_cap"], kv=cache.deq)
    assert rel_err(out, exact) <= TOLERANCE[case["q_dtype"]]
    original = reference_decode(cache, q, starts, 0.125, case["logit_cap"], kv=cache.real)
    assert rel_err(out, original) <= QUANT_ERROR[case["kv_dtype"]]


def test_decode_reads_scales_when_it_runs() -> None:
    """Scales are read on the device at launch: changing them in place (as a calibration does under a captured
    graph) changes the next launch's output accordingly."""
    gen = torch.Generator().manual_seed(4)
    cache = Fp8Cache([90, 33], 2, 64, 64, 1, torch.float8_e4m3fn, gen)
    q = torch.randn(2, 8, 64, generator=gen).to(DEVICE)
    splits = torch.tensor([2, 1], dtype=torch.int32, device=DEVICE)
    run_decode(cache, q, [0, 0], splits, 2, 0.125)
    cache.k_scale.mul_(0.5)
    cache.v_scale.mul_(3.0)
    out = run_decode(cache, q, [0, 0], splits, 2, 0.125)
    assert rel_err(out, reference_decode(cache, q, [0, 0], 0.125, kv=cache.deq)) <= TOLERANCE[torch.float32]


# ---------------------------------------------------------------------------------------------- extend
def extend_reference(cache: Fp8Cache, q, k, v, prefix, ext, sm_scale, *, dequantised: bool, causal=True,
                     window=-1, logit_cap=0.0, allowed_fn=None) -> torch.Tensor:
    """Per request: its prefix from the cache (dequantised, or the original values), then its new tokens as given."""
    keys_all, vals_all = cache.deq if dequantised else cache.real
    outs, t0 = [], 0
    for b, (p, e) in enumerate(zip(prefix, ext)):
        slots = cache.slots(b, 0, p)
        keys = torch.cat([keys_all[slots], k[t0:t0 + e].float()])
        vals = torch.cat([vals_all[slots], v[t0:t0 + e].float()])
        q_pos = p + torch.arange(e, device=DEVICE)
        k_pos = torch.arange(p + e, device=DEVICE)
        allowed = torch.ones(e, p + e, dtype=torch.bool, device=DEVICE)
        if causal:
            allowed &= k_pos[None, :] <= q_pos[:, None]
        if window > 0:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        if allowed_fn is not None:
            allowed &= allowed_fn(b, p, e)
        outs.append(reference_attention(q[t0:t0 + e], keys, vals, allowed, sm_scale, logit_cap))
        t0 += e
    return torch.cat(outs)


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("page_size,heads,window,logit_cap,q_dtype", [
    (1, (2, 4), -1, 0.0, torch.float32),
    (16, (1, 8), 20, 0.0, torch.bfloat16),
    (4, (2, 1), -1, 5.0, torch.float32),
])
def test_extend_over_fp8_matches_reference(kv_dtype, page_size, heads, window, logit_cap, q_dtype) -> None:
    gen = torch.Generator().manual_seed(page_size)
    prefix, ext = [0, 40, 17], [9, 21, 33]
    num_kv_heads, group = heads
    cache = Fp8Cache([p + e for p, e in zip(prefix, ext)], num_kv_heads, 64, 64, page_size, kv_dtype, gen)
    t = sum(ext)
    q = torch.randn(t, num_kv_heads * group, 64, generator=gen).to(q_dtype).to(DEVICE)
    k = torch.randn(t, num_kv_heads, 64, generator=gen).to(q_dtype).to(DEVICE)
    v = torch.randn(t, num_kv_heads, 64, generator=gen).to(q_dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    kv_indices = torch.cat([cache.slots(b, 0, p) for b, p in enumerate(prefix)]).to(torch.int32)
    extend_attention_fwd(q, k, v, out, cache.k_buffer, cache.v_buffer, csr_from_lengths(ext), csr_from_lengths(prefix),
                         kv_indices, max(ext), 0.125, sliding_window=window, logit_cap=logit_cap, **cache.scales)
    kwargs = dict(window=window, logit_cap=logit_cap)
    assert rel_err(out, extend_reference(cache, q, k, v, prefix, ext, 0.125, dequantised=True, **kwargs)) \
        <= TOLERANCE[q_dtype]
    assert rel_err(out, extend_reference(cache, q, k, v, prefix, ext, 0.125, dequantised=False, **kwargs)) \
        <= QUANT_ERROR[kv_dtype]


@pytest.mark.parametrize("kv_dtype", FP8)
def test_tree_mask_over_fp8_matches_reference(kv_dtype) -> None:
    """A verification step's draft trees (a mask over the new keys only; every cached key visible) over an fp8
    prefix, with the new tokens' tree positions for a sliding window."""
    gen = torch.Generator().manual_seed(7)
    parents = [(-1, 0, 0, 1, 1, 2), (-1, 0, 1)]
    prefix, ext = [30, 12], [len(p) for p in parents]
    cache = Fp8Cache([p + e for p, e in zip(prefix, ext)], 2, 64, 64, 4, kv_dtype, gen)

    def ancestors(tree: tuple[int, ...], i: int) -> list[int]:
        path = [i]
        while tree[path[-1]] >= 0:
            path.append(tree[path[-1]])
        return path

    masks = [torch.tensor([[j in ancestors(tree, i) for j in range(len(tree))] for i in range(len(tree))])
             for tree in parents]
    depth = [[len(ancestors(tree, i)) - 1 for i in range(len(tree))] for tree in parents]
    positions = torch.tensor([p + d for p, ds in zip(prefix, depth) for d in ds], dtype=torch.int32, device=DEVICE)
    mask = torch.cat([m.flatten() for m in masks]).to(torch.uint8).to(DEVICE)
    mask_indptr = torch.tensor([0, masks[0].numel(), masks[0].numel() + masks[1].numel()], device=DEVICE)
    t, window = sum(ext), 25
    q = torch.randn(t, 4, 64, generator=gen).to(DEVICE)
    k = torch.randn(t, 2, 64, generator=gen).to(DEVICE)
    v = torch.randn(t, 2, 64, generator=gen).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    kv_indices = torch.cat([cache.slots(b, 0, p) for b, p in enumerate(prefix)]).to(torch.int32)
    extend_attention_fwd(q, k, v, out, cache.k_buffer, cache.v_buffer, csr_from_lengths(ext), csr_from_lengths(prefix),
                         kv_indices, max(ext), 0.125, sliding_window=window, custom_mask=mask, mask_indptr=mask_indptr,
                         mask_new_keys_only=True, positions=positions, **cache.scales)

    def tree_allowed(b: int, p: int, e: int) -> torch.Tensor:  # cached keys by window on tree positions
        pos = positions[sum(ext[:b]):sum(ext[:b]) + e]
        k_pos = torch.cat([torch.arange(p, device=DEVICE), pos])
        allowed = torch.cat([torch.ones(e, p, dtype=torch.bool, device=DEVICE), masks[b].to(DEVICE)], dim=1)
        return allowed & (k_pos[None, :] > pos[:, None] - window)

    ref = extend_reference(cache, q, k, v, prefix, ext, 0.125, dequantised=True, causal=False, allowed_fn=tree_allowed)
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]


# ---------------------------------------------------------------------------------------------- cascade
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("split_levels", [False, True])
def test_cascade_over_fp8_matches_reference(kv_dtype, split_levels) -> None:
    """Requests 0 and 2 share a 40-token prefix (same slots); request 1 shares nothing."""
    gen = torch.Generator().manual_seed(11)
    lengths = [55, 30, 47]
    cache = Fp8Cache(lengths, 2, 64, 64, 1, kv_dtype, gen)
    table = cache.req_to_token
    table[int(cache.rows[2]), :40] = table[int(cache.rows[0]), :40]
    index = build_cascade_index(table, cache.rows, torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
                                [([0, 2], 40)], req_pool_indices_cpu=cache.rows.tolist(), seq_lens_cpu=lengths)
    q = torch.randn(3, 8, 64, generator=gen).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    cascade_decode_fwd(q, cache.k_buffer, cache.v_buffer, out, index, 0.125, num_prefix_splits=2,
                       split_levels=split_levels, **cache.scales)
    exact = reference_decode(cache, q, [0, 0, 0], 0.125, kv=cache.deq)
    assert rel_err(out, exact) <= TOLERANCE[torch.float32]
    assert rel_err(out, reference_decode(cache, q, [0, 0, 0], 0.125, kv=cache.real)) <= QUANT_ERROR[kv_dtype]


# ---------------------------------------------------------------------------------------------- argument errors
def test_fp8_scales_are_checked() -> None:
    gen = torch.Generator().manual_seed(1)
    cache = Fp8Cache([5], 2, 64, 64, 1, torch.float8_e4m3fn, gen)
    k = torch.randn(1, 2, 64, device=DEVICE)
    loc = torch.tensor([1], device=DEVICE)
    with pytest.raises(ValueError, match="needs k_scale"):
        store_kv(cache.k_buffer, cache.v_buffer, loc, k, k)
    with pytest.raises(ValueError, match=r"v_scale must be float32 of shape \(2,\)"):
        store_kv(cache.k_buffer, cache.v_buffer, loc, k, k, k_scale=cache.k_scale, v_scale=cache.v_scale[:1])
    bf16 = torch.zeros(8, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="only fp8 caches"):
        store_kv(bf16, bf16, loc, k, k, k_scale=cache.k_scale, v_scale=cache.v_scale)


# ---------------------------------------------------------------------------------------------- GPU, realistic sizes
@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("bs,ctx,page_size", [(64, 4096, 1), (8, 8192, 16), (200, 700, 16)])
def test_gpu_decode_over_fp8_at_serving_sizes(kv_dtype, bs, ctx, page_size) -> None:
    """The Llama-3.2-1B attention shape (32 q / 8 KV heads, head dim 64), bf16 queries, one-launch decode with the
    fused store, against the float64 reference over the dequantised cache and the original values."""
    gen = torch.Generator().manual_seed(bs)
    lengths = torch.randint(ctx // 2, ctx, (bs,), generator=gen).tolist()
    cache = Fp8Cache(lengths, 8, 64, 64, page_size, kv_dtype, gen)
    q = torch.randn(bs, 32, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    k_new = cache.k_real[torch.stack([cache.slots(b)[-1] for b in range(bs)])].to(torch.bfloat16)
    v_new = cache.v_real[torch.stack([cache.slots(b)[-1] for b in range(bs)])].to(torch.bfloat16)
    new_loc = torch.stack([cache.slots(b)[-1] for b in range(bs)])
    splits = compute_num_kv_splits(torch.tensor(lengths, device=DEVICE), 132, 16, num_kv_heads=8)
    out = run_decode(cache, q, [0] * bs, splits, 16, 0.125, new_tokens=(k_new, v_new, new_loc), one_launch=True)
    assert same_bits(cache.k_buffer[new_loc], quantize(k_new, cache.k_scale, kv_dtype))
    over_stored = reference_decode(cache, q, [0] * bs, 0.125, kv=cache.deq)
    over_real = reference_decode(cache, q, [0] * bs, 0.125, kv=cache.real)
    assert rel_err(out, over_stored) <= TOLERANCE[torch.bfloat16]
    # Against the original values the kernel adds nothing to the quantisation's own effect (which grows with the
    # context relative to an output that averages thousands of random values: 0.13 at 64 x 4096 for e4m3).
    assert rel_err(out, over_real) <= rel_err(over_stored, over_real) + TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
def test_gpu_store_kv_matches_kv_fp8_at_serving_sizes(kv_dtype) -> None:
    """The compiled store (the GPU's saturating round-to-nearest-even conversion) against ``kv/fp8.quantize``."""
    gen = torch.Generator().manual_seed(3)
    k = (torch.randn(4096, 8, 128, generator=gen) * torch.logspace(-3, 3, 4096)[:, None, None]).to(torch.bfloat16)
    k = k.to(DEVICE)
    k_scale = amax_scales(k, kv_dtype, spread=0.05)
    buf = torch.zeros(4097, 8, 128, dtype=kv_dtype, device=DEVICE)
    loc = torch.randperm(4096, generator=gen).to(DEVICE) + 1
    store_kv(buf, buf.clone(), loc, k, k, k_scale=k_scale, v_scale=k_scale)
    assert same_bits(buf[loc], quantize(k, k_scale, kv_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
def test_gpu_extend_over_fp8_at_serving_sizes(kv_dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    prefix, ext = [3000, 0, 1200, 511], [512, 700, 64, 1]
    cache = Fp8Cache([p + e for p, e in zip(prefix, ext)], 8, 64, 64, 16, kv_dtype, gen)
    t = sum(ext)
    q = torch.randn(t, 32, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    k = torch.randn(t, 8, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(t, 8, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    out = torch.empty_like(q)
    kv_indices = torch.cat([cache.slots(b, 0, p) for b, p in enumerate(prefix)]).to(torch.int32)
    extend_attention_fwd(q, k, v, out, cache.k_buffer, cache.v_buffer, csr_from_lengths(ext), csr_from_lengths(prefix),
                         kv_indices, max(ext), 1 / math.sqrt(64), sliding_window=1024, **cache.scales)
    ref = extend_reference(cache, q, k, v, prefix, ext, 1 / math.sqrt(64), dequantised=True, window=1024)
    assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]
