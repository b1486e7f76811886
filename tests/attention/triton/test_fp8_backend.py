"""The triton backend over an fp8 KV pool (``PagedKVPool.kv_scales``): decode, extend, mixed, verification trees and
shared-prefix decode through the attention op, against the float64 reference over the pool's dequantised values;
the step's K/V stored as ``kv/fp8.quantize`` stores them; graph-bound decode reading the scales' current values.

What each path attends to: a decode step its new token as stored (quantised), and so do a mixed batch's leading decode
rows (they run in the decode kernel, ``attention/triton/mixed.py``); an extend / mixed / verification step's other
rows their new tokens as given (the prefix from the pool). The kernels' own tests (tests/attention/kernels/test_fp8_kv.py)
bound the quantisation error against the original values.
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.attention.fp8_pool import as_stored, dequantized_pool
from tests.attention.harness import TOL, Case, padded_decode_batch
from tests.attention.verify_harness import VerifyCase, reference_verify
from tests.batch_factory import fill_prefixes, random_step
from tests.reference import max_rel_error, reference_attention

from compile_attn import ForwardBatch, ForwardMode, create_backend, forward_context
from compile_attn.kv.fp8 import fp8_max, quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
F32, BF16 = torch.float32, torch.bfloat16
W = {"window": 9, "logit_cap": 30.0}
CASES = [
    pytest.param(Case.named("decode", group=4, page_size=16), id="decode-gqa4-p16"),
    pytest.param(Case.named("decode", group=2, page_size=1, **W), id="decode-p1-window-cap"),
    pytest.param(Case((150, 2), (1, 1), group=4, page_size=16), id="decode-long-multisplit"),
    pytest.param(Case.named("extend", group=8, page_size=1, **W), id="extend-gqa8-p1-window-cap"),
    pytest.param(Case.named("prefix", group=4, page_size=16), id="prefix-p16"),
    pytest.param(Case.named("mixed", group=1, page_size=4), id="mixed-gqa1-p4"),
]


def set_scales(kv, dtype: torch.dtype) -> None:
    """Per-layer, per-head scales that differ (unit-variance data: amax about 4-5), set in place as a loader would."""
    heads = kv.pool.num_kv_heads
    for layer_id in range(kv.pool.num_layers):
        k_scale, v_scale = kv.pool.kv_scales(layer_id)
        k_scale.copy_(torch.linspace(4.0, 6.0, heads) * (layer_id + 1) / fp8_max(dtype))
        v_scale.copy_(torch.linspace(5.0, 3.0, heads) / fp8_max(dtype))


def decode_kernel_rows(fb: ForwardBatch) -> int:
    """Tokens the decode kernel attends to (as stored): all of a decode step's; of an extend or mixed batch, its
    leading rows of one new token over a cached prefix when prefill rows follow them; none of a verify step's."""
    if fb.forward_mode.is_decode():
        return fb.num_tokens
    if fb.forward_mode not in (ForwardMode.EXTEND, ForwardMode.MIXED) or fb.draft_parents is not None:
        return 0
    rows = 0
    while rows < fb.batch_size and fb.extend_seq_lens_cpu[rows] == 1 and fb.extend_prefix_lens_cpu[rows] > 0:
        rows += 1
    return rows if rows < fb.batch_size else 0


def run_fp8_case(case: Case, kv_dtype: torch.dtype, q_dtype: torch.dtype, seed: int = 0,
                 backend_kwargs: dict | None = None) -> list[float]:
    """Every layer of ``case`` through the op over an fp8 pool; checks the stored bytes; returns the errors against
    the float64 reference over the dequantised pool."""
    layers = case.layers()
    kv = case.make_kv(DEVICE, kv_dtype)
    set_scales(kv, kv_dtype)
    gen = torch.Generator().manual_seed(seed)
    step = random_step(kv, list(case.prefix), list(case.extend), case.num_heads, gen, dtype=q_dtype,
                       forward_mode=case.mode)
    fb = step.batch
    backend = create_backend("triton", kv, layers, **(backend_kwargs or {"split_size": 64, "max_kv_splits": 4}))
    backend.init_forward_metadata(fb)
    errors = []
    for layer in layers:
        q, k, v = step.q, step.k, step.v
        if layer.layer_id:
            q, k, v = (torch.randn(t.shape, generator=gen).to(device=DEVICE, dtype=q_dtype) for t in (q, k, v))
        out = torch.full((q.shape[0], case.num_heads, case.dv), float("nan"), dtype=q_dtype, device=DEVICE)
        with forward_context(fb, backend):
            torch.ops.compile_attn.attention(q, k, v, out, layer.layer_id)
        assert not out.isnan().any()
        k_scale, v_scale = kv.pool.kv_scales(layer.layer_id)
        k_pool, v_pool = kv.pool.get_kv(layer.layer_id)
        loc = fb.out_cache_loc
        assert torch.equal(k_pool[loc].view(torch.uint8), quantize(k, k_scale, kv_dtype).view(torch.uint8))
        assert torch.equal(v_pool[loc].view(torch.uint8), quantize(v, v_scale, kv_dtype).view(torch.uint8))
        d = decode_kernel_rows(fb)  # decode attends to its new token as stored
        if d:
            k = torch.cat([as_stored(k[:d], k_scale, kv_dtype), k[d:]])
            v = torch.cat([as_stored(v[:d], v_scale, kv_dtype), v[d:]])
        expected = reference_attention(
            q, k, v, *dequantized_pool(kv, layer.layer_id), kv.req_to_token, step.rows, step.prefix_lens,
            step.extend_lens, scaling=layer.scaling, sliding_window=layer.sliding_window, logit_cap=layer.logit_cap)
        errors.append(max_rel_error(out, expected))
    return errors


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("case", CASES)
def test_fp8_pool_matches_reference_over_dequantised_kv(case: Case, kv_dtype: torch.dtype) -> None:
    for layer_id, err in enumerate(run_fp8_case(case, kv_dtype, F32)):
        assert err < TOL[F32], f"layer {layer_id}: relative error {err:.2e}"


@pytest.mark.parametrize("kv_dtype", FP8)
def test_fp8_pool_with_bf16_queries(kv_dtype: torch.dtype) -> None:
    for case in (Case.named("decode", group=4, page_size=16), Case.named("mixed", group=2, page_size=1)):
        for err in run_fp8_case(case, kv_dtype, BF16):
            assert err < TOL[BF16]


@pytest.mark.parametrize("kwargs", [{"one_launch_decode": False}, {"deterministic": True}])
def test_fp8_pool_two_launch_and_deterministic_decode(kwargs: dict) -> None:
    case = Case((150, 2, 40), (1, 1, 1), group=4, page_size=1)
    for err in run_fp8_case(case, torch.float8_e4m3fn, F32, backend_kwargs={"max_kv_splits": 4, **kwargs}):
        assert err < TOL[F32]


def test_fp8_pool_decode_stores_first() -> None:
    """store_decode_kv_first (verification chains as decode rows): one store launch, then the kernel attends."""
    case = Case.named("decode", group=4, page_size=16)
    kv = case.make_kv(DEVICE, torch.float8_e5m2)
    set_scales(kv, torch.float8_e5m2)
    gen = torch.Generator().manual_seed(3)
    step = random_step(kv, list(case.prefix), list(case.extend), case.num_heads, gen, dtype=F32)
    backend = create_backend("triton", kv, case.layers())
    assert backend.store_decode_kv_first()
    backend.init_forward_metadata(step.batch)
    out = torch.empty(step.q.shape, device=DEVICE)
    with forward_context(step.batch, backend):
        torch.ops.compile_attn.attention(step.q, step.k, step.v, out, 0)
    k_scale, v_scale = kv.pool.kv_scales(0)
    expected = reference_attention(
        step.q, as_stored(step.k, k_scale, kv.pool.dtype), as_stored(step.v, v_scale, kv.pool.dtype),
        *dequantized_pool(kv, 0), kv.req_to_token, step.rows, step.prefix_lens, step.extend_lens,
        scaling=case.layers()[0].scaling)
    assert max_rel_error(out, expected) < TOL[F32]


@pytest.mark.parametrize("kv_dtype", FP8)
def test_fp8_pool_verifies_draft_trees(kv_dtype: torch.dtype) -> None:
    case = VerifyCase((7, 0, 20), ((-1, 0, 0, 1, 2), (-1,), (-1, 0, 1, 1)), group=2, page_size=4, window=6,
                      logit_cap=5.0)
    gen = torch.Generator().manual_seed(1)
    kv = case.make_kv(DEVICE, kv_dtype)
    set_scales(kv, kv_dtype)
    rows = [kv.alloc_request() for _ in case.parents]
    fill_prefixes(kv, rows, list(case.prefix), gen)
    loc = kv.alloc_extend(rows, case.extend)
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=case.prefix, extend_lens=case.extend, out_cache_loc=loc,
                            forward_mode=ForwardMode.TARGET_VERIFY, draft_parents=case.parents, device=DEVICE)
    backend = create_backend("triton", kv, case.layers())
    backend.init_forward_metadata(fb)
    n = fb.num_tokens
    for layer in case.layers():
        q = torch.randn(n, case.num_heads, case.head_dim, generator=gen).to(DEVICE)
        k = torch.randn(n, case.num_kv_heads, case.head_dim, generator=gen).to(DEVICE)
        v = torch.randn(n, case.num_kv_heads, case.head_dim, generator=gen).to(DEVICE)
        out = torch.full_like(q, math.nan)
        with forward_context(fb, backend):
            torch.ops.compile_attn.attention(q, k, v, out, layer.layer_id)
        expected = reference_verify(q, k, v, *dequantized_pool(kv, layer.layer_id), kv.req_to_token, rows, case,
                                    layer)
        assert max_rel_error(out, expected) < TOL[F32]


@pytest.mark.parametrize("kv_dtype", FP8)
def test_fp8_pool_graph_bound_decode_reads_current_scales(kv_dtype: torch.dtype) -> None:
    """A decode bound to the static graph buffers (what a captured graph replays; captured on a GPU), run, then run
    again after the scales changed in place: the second run reads the new scales, for the store and the attention."""
    case = Case.named("decode", group=4, page_size=16)
    kv = case.make_kv(DEVICE, kv_dtype)
    set_scales(kv, kv_dtype)
    gen = torch.Generator().manual_seed(5)
    step = random_step(kv, list(case.prefix), list(case.extend), case.num_heads, gen, dtype=F32)
    backend = create_backend("triton", kv, case.layers())
    bucket = step.batch.batch_size + 2
    backend.init_cuda_graph_state(bucket, bucket)
    fb = padded_decode_batch(step, bucket)
    q = torch.cat([step.q, torch.randn(2, *step.q.shape[1:], generator=gen).to(DEVICE)])
    k = torch.cat([step.k, torch.randn(2, *step.k.shape[1:], generator=gen).to(DEVICE)])
    v = torch.cat([step.v, torch.randn(2, *step.v.shape[1:], generator=gen).to(DEVICE)])
    out = torch.zeros(q.shape, device=DEVICE)
    live = step.batch.batch_size

    def run() -> None:
        with forward_context(fb, backend, graph_mode="full"):
            backend.init_forward_metadata_in_graph(fb)
            torch.ops.compile_attn.attention(q, k, v, out, 0)

    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    graph = None
    run()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    for factor in (1.0, 0.5):
        k_scale, v_scale = kv.pool.kv_scales(0)
        k_scale.mul_(factor)
        v_scale.mul_(1 / factor)
        backend.init_forward_metadata_out_graph(fb)
        if graph is not None:
            graph.replay()
        else:
            run()
        k_pool, _ = kv.pool.get_kv(0)
        loc = step.batch.out_cache_loc
        assert torch.equal(k_pool[loc].view(torch.uint8), quantize(step.k, k_scale, kv_dtype).view(torch.uint8))
        expected = reference_attention(
            step.q, as_stored(step.k, k_scale, kv_dtype), as_stored(step.v, v_scale, kv_dtype),
            *dequantized_pool(kv, 0), kv.req_to_token, step.rows, step.prefix_lens, step.extend_lens,
            scaling=case.layers()[0].scaling)
        assert max_rel_error(out[:live], expected) < TOL[F32]


@pytest.mark.parametrize("kv_dtype", FP8)
def test_fp8_pool_shared_prefix_decode(kv_dtype: torch.dtype) -> None:
    """A decode batch with a shared-prefix group takes the cascade kernels, which store the step's K/V quantised and
    read the pool with its scales."""
    from tests.attention.triton.test_cascade_backend import HKV, HQ, D, decode_step, shared_cache

    from compile_attn.batch import SharedPrefixGroup
    from compile_attn.layer import AttentionLayer

    gen = torch.Generator().manual_seed(2)
    kv, rows, lens, _ = shared_cache(4, 48, [3, 1, 6, 2], gen, device=DEVICE, dtype=kv_dtype)  # scales 1 so far
    for layer_id in range(kv.pool.num_layers):  # the stored bytes now mean stored * scale
        k_scale, v_scale = kv.pool.kv_scales(layer_id)
        k_scale.copy_(torch.linspace(0.5, 2.0, HKV))
        v_scale.copy_(torch.linspace(3.0, 0.25, HKV))
    layers = [AttentionLayer(layer_id=i, num_heads=HQ, num_kv_heads=HKV, head_dim=D) for i in range(2)]
    backend = create_backend("triton", kv, layers)
    fb = decode_step(kv, rows, lens)
    fb.shared_prefix = (SharedPrefixGroup((0, 1, 2, 3), 48),)
    backend.init_forward_metadata(fb)
    assert backend.cascade.steps == 1
    n = len(rows)
    for layer in layers:
        q = torch.randn(n, HQ, D, generator=gen).to(DEVICE)
        k, v = (torch.randn(n, HKV, D, generator=gen).to(DEVICE) for _ in range(2))
        out = torch.full((n, HQ, D), float("nan"), device=DEVICE)
        backend.forward(q, k, v, layer, fb, out)
        k_scale, v_scale = kv.pool.kv_scales(layer.layer_id)
        expected = reference_attention(
            q, as_stored(k, k_scale, kv_dtype), as_stored(v, v_scale, kv_dtype), *dequantized_pool(kv, layer.layer_id),
            kv.req_to_token, rows, lens, [1] * n, scaling=layer.scaling)
        assert max_rel_error(out, expected) < TOL[F32]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("kind,page_size", [("decode", 1), ("decode", 16), ("mixed", 16), ("prefix", 1)])
def test_gpu_fp8_pool_at_serving_sizes(kind: str, page_size: int, kv_dtype: torch.dtype) -> None:
    """Llama-3.2-1B attention (32 q / 8 KV heads, head dim 64), bf16 activations, thousands of cached tokens."""
    lengths = {"decode": ((4000, 2500, 3100, 900) * 4, (1,) * 16), "mixed": ((3000, 0, 1200, 50), (1, 700, 1, 64)),
               "prefix": ((2048, 512), (300, 1000))}[kind]
    case = Case(*lengths, num_kv_heads=8, group=4, page_size=page_size, window=1024 if kind == "prefix" else None,
                mode=ForwardMode.MIXED if kind == "mixed" else None)
    for err in run_fp8_case(case, kv_dtype, BF16, backend_kwargs={}):
        assert err < TOL[BF16]
