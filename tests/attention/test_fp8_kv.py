"""Attention over an fp8 KV cache against the float64 reference, for every backend that reads one.

Each case fills request prefixes with K/V whose KV heads differ in magnitude (V by 100x, K by 5x, keeping the
scores' spread near a trained model's: per-head scales matter),
stores them through the pool (quantised with per-head scales), then runs one step through the attention op and
compares with ``tests/reference.py``:

* over the dequantised KV (the pool's bytes times the scales; the step's new K/V rounded through the same format):
  the backend's own arithmetic error only, tight;
* over the original float K/V: the quantisation error, bounded by ``QUANT_BOUND`` (max |error| / max |output|).
  fp8_e4m3 keeps 3 mantissa bits (a value's error <= 2^-4 of it), fp8_e5m2 2 bits (<= 2^-3): a query attending to
  one key gets that error on V directly, and the scores' error adds a little (measured worst over these cases:
  0.077 e4m3, 0.14 e5m2; typically a third of that).

On the CPU: torch_native (float32 queries). On a GPU (``gpu`` marker): flashinfer and fa3 in bfloat16 (fa3 quantises
the queries too: a looser tight bound).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_attn import AttentionLayer, KVCache, create_backend, forward_context
from compile_attn.kv.fp8 import fp8_max, quantize
from tests.attention.fp8_pool import as_stored, dequantized_pool
from tests.attention.harness import LENGTHS, padded_decode_batch
from tests.batch_factory import random_step
from tests.reference import max_rel_error, reference_attention

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
QUANT_BOUND = {E4M3: 0.1, E5M2: 0.2}  # vs the original KV: 2^-4 / 2^-3 of V, plus the scores' share


@dataclass(frozen=True)
class Target:
    backend: str
    device: str
    q_dtype: torch.dtype
    tight: float  # vs the dequantised KV


CPU = Target("torch_native", "cpu", torch.float32, 1e-5)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


GPU_TARGETS = [
    pytest.param(Target("torch_native", "cuda", torch.bfloat16, 1e-2), marks=pytest.mark.gpu, id="torch_native-cuda"),
    pytest.param(Target("flashinfer", "cuda", torch.bfloat16, 2e-2), id="flashinfer",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not _installed("flashinfer"), reason="no flashinfer")]),
    pytest.param(Target("fa3", "cuda", torch.bfloat16, 6e-2), id="fa3",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not _installed("sgl_kernel"), reason="no sgl_kernel")]),
]


def run_fp8_case(target: Target, kv_dtype: torch.dtype, prefix: list[int], extend: list[int], *, page_size: int,
                 num_kv_heads: int = 2, group: int = 4, window: int | None = None, head_dim: int = 64,
                 seed: int = 0, bucket: int | None = None) -> tuple[float, float]:
    """One step of ``extend`` new tokens over ``prefix`` cached ones per request (a decode step when every extend
    is 1 and every prefix > 0; with ``bucket``, padded to a graph bucket of that many rows and run over the
    backend's static graph buffers); returns (error vs dequantised KV, error vs original KV)."""
    gen = torch.Generator().manual_seed(seed)
    dev = target.device
    prefix, extend = list(prefix), list(extend)
    seq = [p + e for p, e in zip(prefix, extend)]
    kv = KVCache(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, max_batch_size=len(seq) + 1,
                 max_context=max(seq) + 1, kv_cache_tokens=sum(seq) + len(seq) * page_size, page_size=page_size,
                 dtype=kv_dtype, device=dev)
    pool = kv.pool
    k_gain = torch.linspace(0.3, 1.5, num_kv_heads)[None, :, None]  # KV heads 5x apart
    v_gain = torch.logspace(-1, 1, num_kv_heads)[None, :, None]  # 100x apart
    # per-head scales as calibration would set them (margin 2 over this data's amax, ~4.5 sigma), before any store
    k_scale = 2 * k_gain.flatten() * 4.5 / fp8_max(kv_dtype)
    v_scale = 2 * v_gain.flatten() * 4.5 / fp8_max(kv_dtype)
    pool.k_scales[0].copy_(k_scale)
    pool.v_scales[0].copy_(v_scale)
    pool.scale_calibration = None  # scales given
    n, hq = sum(extend), num_kv_heads * group
    step = random_step(kv, prefix, extend, hq, gen, dtype=target.q_dtype, shuffle_pages=False,
                       gains=(k_gain, v_gain))
    q, k, v, fb, loc = step.q, step.k, step.v, step.batch, step.batch.out_cache_loc
    k_orig = torch.zeros(pool.num_slots, num_kv_heads, head_dim, device=dev)  # the prefixes before quantising
    v_orig = torch.zeros_like(k_orig)
    k_orig[step.prefix_loc], v_orig[step.prefix_loc] = step.prefix_kv[0]
    layer = AttentionLayer(0, hq, num_kv_heads, head_dim, sliding_window=window)
    backend = create_backend(target.backend, kv, [layer])
    pad = 0
    if bucket is None:
        backend.init_forward_metadata(fb)
    else:  # a decode graph bucket: padded rows on the scratch request and slot, static buffers
        pad = bucket - n
        fb = padded_decode_batch(step, bucket)
        backend.init_cuda_graph_state(bucket, bucket)
        backend.init_forward_metadata_out_graph(fb, in_capture=True)
        backend.init_forward_metadata_in_graph(fb)
    qp, kp, vp = (torch.cat([x, torch.randn(pad, *x.shape[1:], generator=gen).to(x)]) for x in (q, k, v))
    out = torch.full((n + pad, hq, head_dim), float("nan"), dtype=target.q_dtype, device=dev)
    with forward_context(fb, backend, graph_mode="full" if bucket else None):
        torch.ops.compile_attn.attention(qp, kp, vp, out, 0)
    assert not out.isnan().any()
    out = out[:n]
    # the step's K/V reached the pool quantised with the layer's scales
    stored = pool.k_buffers[0].view(torch.uint8)[loc].view(kv_dtype)
    assert torch.equal(stored.view(torch.uint8), quantize(k, k_scale.to(dev), kv_dtype).view(torch.uint8))
    args = (kv.req_to_token, step.rows, prefix, extend)
    opts = dict(scaling=layer.scaling, sliding_window=window)
    k_new, v_new = as_stored(k, pool.k_scales[0], kv_dtype), as_stored(v, pool.v_scales[0], kv_dtype)
    tight = reference_attention(q, k_new, v_new, *dequantized_pool(kv, 0), *args, **opts)
    loose = reference_attention(q, k, v, k_orig, v_orig, *args, **opts)
    return max_rel_error(out, tight), max_rel_error(out, loose)


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", list(LENGTHS))
@pytest.mark.parametrize("window", [None, 9])
def test_fp8_cache_cpu(kv_dtype: torch.dtype, page_size: int, kind: str, window: int | None) -> None:
    tight, loose = run_fp8_case(CPU, kv_dtype, *LENGTHS[kind], page_size=page_size, window=window)
    assert tight < CPU.tight, f"vs the dequantised KV: {tight}"
    assert loose < QUANT_BOUND[kv_dtype], f"vs the original KV: {loose}"


@settings(max_examples=25, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=5),
    page_size=st.sampled_from([1, 16]),
    group=st.sampled_from([1, 4]),
    window=st.sampled_from([None, 5]),
    kv_dtype=st.sampled_from([E4M3, E5M2]),
    seed=st.integers(0, 2**16),
)
def test_fp8_cache_random_batches_cpu(reqs: list[tuple[int, int]], page_size: int, group: int, window: int | None,
                                      kv_dtype: torch.dtype, seed: int) -> None:
    prefix, extend = [p for p, _ in reqs], [e for _, e in reqs]
    tight, loose = run_fp8_case(CPU, kv_dtype, prefix, extend, page_size=page_size, group=group, window=window,
                                seed=seed)
    assert tight < CPU.tight
    assert loose < QUANT_BOUND[kv_dtype]


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_decode_over_graph_buffers_cpu(kv_dtype: torch.dtype, page_size: int) -> None:
    """torch_native's graph-bucket decode (static slot table, padded rows) reads the fp8 pool dequantised too."""
    tight, loose = run_fp8_case(CPU, kv_dtype, *LENGTHS["decode"], page_size=page_size, window=9, bucket=6)
    assert tight < CPU.tight and loose < QUANT_BOUND[kv_dtype]


@pytest.mark.parametrize("target", GPU_TARGETS)
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", list(LENGTHS))
def test_fp8_cache_gpu(target: Target, kv_dtype: torch.dtype, page_size: int, kind: str) -> None:
    if target.backend == "fa3" and kv_dtype is E5M2:
        pytest.skip("fa3 has no e5m2 kernels (refused by name: test_fa3_refuses_e5m2)")
    for window in (None, 9):
        tight, loose = run_fp8_case(target, kv_dtype, *LENGTHS[kind], page_size=page_size, window=window)
        assert tight < target.tight, f"window {window}: vs the dequantised KV: {tight}"
        assert loose < QUANT_BOUND[kv_dtype] + target.tight, f"window {window}: vs the original KV: {loose}"


@pytest.mark.gpu
@pytest.mark.skipif(not _installed("sgl_kernel"), reason="no sgl_kernel")
def test_fa3_refuses_e5m2() -> None:
    from compile_attn.errors import UnsupportedConfigError

    kv = KVCache(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=2, max_context=8, kv_cache_tokens=16,
                 dtype=E5M2, device="cuda")
    with pytest.raises(UnsupportedConfigError, match="e4m3 only.*fp8_e5m2"):
        create_backend("fa3", kv, [AttentionLayer(0, 8, 2, 64)])
