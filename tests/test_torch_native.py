"""torch_native against the float64 reference: hypothesis batches, decode graph-buffer path, contract."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.batch_factory import random_step
from compile_attn import AttentionLayer, ForwardMode, KVCache, create_backend, forward_context
from tests.reference import max_rel_error, reference_attention

HEAD_DIM = 16


@st.composite
def attention_cases(draw: st.DrawFn) -> dict:
    num_kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 4, 8]))
    bs = draw(st.integers(1, 4))
    decode = draw(st.booleans())
    prefix = draw(st.lists(st.integers(1 if decode else 0, 40), min_size=bs, max_size=bs))
    extend = [1] * bs if decode else draw(st.lists(st.integers(1, 24), min_size=bs, max_size=bs))
    return dict(
        num_kv_heads=num_kv_heads,
        num_heads=num_kv_heads * group,
        prefix=prefix,
        extend=extend,
        page_size=draw(st.sampled_from([1, 16])),
        window=draw(st.sampled_from([None, 1, 5, 17])),
        logit_cap=draw(st.sampled_from([0.0, 5.0])),
        seed=draw(st.integers(0, 2**16)),
    )


def run_backend(case: dict, device: str = "cpu", dtype: torch.dtype = torch.float32, use_graph_buffers: bool = False):
    kv = KVCache(
        num_layers=1, num_kv_heads=case["num_kv_heads"], head_dim=HEAD_DIM, max_batch_size=8, max_context=128,
        kv_cache_tokens=1024, page_size=case["page_size"], dtype=dtype, device=device,
    )
    layer = AttentionLayer(0, case["num_heads"], case["num_kv_heads"], HEAD_DIM,
                           sliding_window=case["window"], logit_cap=case["logit_cap"])
    gen = torch.Generator().manual_seed(case["seed"])
    step = random_step(kv, case["prefix"], case["extend"], case["num_heads"], gen, dtype=dtype)
    backend = create_backend("torch_native", kv, [layer])
    fb = step.batch
    if use_graph_buffers:
        backend.init_cuda_graph_state(max_bs=8, max_num_tokens=64)
        fb.graph_bucket = fb.batch_size
    out = torch.full_like(step.q, float("nan"))
    expected = reference_attention(
        step.q, step.k, step.v, *kv.pool.get_kv(0), kv.req_to_token, step.rows, step.prefix_lens, step.extend_lens,
        scaling=layer.scaling, sliding_window=layer.sliding_window, logit_cap=layer.logit_cap,
    )
    backend.init_forward_metadata(fb)
    with forward_context(fb, backend):
        torch.ops.compile_attn.attention(step.q, step.k, step.v, out, 0)
    return out, expected, kv, step


@given(attention_cases())
def test_matches_float64_reference(case: dict) -> None:
    out, expected, kv, step = run_backend(case)
    assert not out.isnan().any()
    assert max_rel_error(out, expected) < 1e-5
    # the step's new K/V landed at out_cache_loc in the pool
    k_pool, v_pool = kv.pool.get_kv(0)
    torch.testing.assert_close(k_pool[step.batch.out_cache_loc], step.k)
    torch.testing.assert_close(v_pool[step.batch.out_cache_loc], step.v)


@given(attention_cases().filter(lambda c: set(c["extend"]) == {1} and min(c["prefix"]) > 0))
def test_decode_through_static_graph_buffers(case: dict) -> None:
    out, expected, _, step = run_backend(case, use_graph_buffers=True)
    assert step.batch.forward_mode is ForwardMode.DECODE
    assert max_rel_error(out, expected) < 1e-5


def test_mixed_batch_decode_and_prefill_in_one_step() -> None:
    case = dict(num_kv_heads=2, num_heads=8, prefix=[7, 0, 30, 12], extend=[1, 9, 1, 5], page_size=16,
                window=None, logit_cap=0.0, seed=3)
    out, expected, _, _ = run_backend(case)
    assert max_rel_error(out, expected) < 1e-5


def test_without_saving_kv_uses_the_new_tokens_and_leaves_the_pool_alone() -> None:
    case = dict(num_kv_heads=1, num_heads=4, prefix=[5, 3], extend=[1, 1], page_size=1, window=None,
                logit_cap=0.0, seed=0)
    kv = KVCache(num_layers=1, num_kv_heads=1, head_dim=HEAD_DIM, max_batch_size=4, max_context=32, kv_cache_tokens=64,
                 dtype=torch.float32)
    layer = AttentionLayer(0, 4, 1, HEAD_DIM)
    step = random_step(kv, case["prefix"], case["extend"], 4, torch.Generator().manual_seed(1))
    backend = create_backend("torch_native", kv, [layer])
    before = kv.pool.k_buffers[0].clone()
    out = torch.empty_like(step.q)
    backend.init_forward_metadata(step.batch)
    with forward_context(step.batch, backend):
        torch.ops.compile_attn.attention(step.q, step.k, step.v, out, 0, save_kv_cache=False)
    assert torch.equal(kv.pool.k_buffers[0], before)
    expected = reference_attention(step.q, step.k, step.v, *kv.pool.get_kv(0), kv.req_to_token, step.rows,
                                   step.prefix_lens, step.extend_lens, scaling=layer.scaling)
    assert max_rel_error(out, expected) < 1e-5


@pytest.mark.gpu
@given(attention_cases())
def test_matches_reference_on_cuda_bf16(case: dict) -> None:
    out, expected, _, _ = run_backend(case, device="cuda", dtype=torch.bfloat16)
    assert not out.isnan().any()
    assert max_rel_error(out, expected) < 1e-2


@pytest.mark.gpu
def test_full_decode_cuda_graph_replays_new_batches() -> None:
    """Capture the three-method decode path once; replay it for fresh batches of the same bucket."""
    torch.manual_seed(0)
    bucket, layer = 4, AttentionLayer(0, 8, 2, HEAD_DIM, sliding_window=9)
    kv = KVCache(num_layers=1, num_kv_heads=2, head_dim=HEAD_DIM, max_batch_size=64, max_context=128,
                 kv_cache_tokens=8192, page_size=16, dtype=torch.float16, device="cuda")
    backend = create_backend("torch_native", kv, [layer])
    backend.init_cuda_graph_state(max_bs=bucket, max_num_tokens=bucket)
    gen = torch.Generator().manual_seed(0)
    first = random_step(kv, [3, 10, 40, 7], [1] * bucket, 8, gen)
    static = first.batch
    static.graph_bucket = bucket
    q, k, v = first.q.clone(), first.k.clone(), first.v.clone()
    out = torch.empty_like(q)
    backend.init_forward_metadata_out_graph(static, in_capture=True)
    with forward_context(static, backend, graph_mode="full"):
        backend.init_forward_metadata_in_graph(static)
        torch.ops.compile_attn.attention(q, k, v, out, 0)  # warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            backend.init_forward_metadata_in_graph(static)
            torch.ops.compile_attn.attention(q, k, v, out, 0)
    for trial in range(5):
        step = random_step(kv, torch.randint(1, 100, (bucket,), generator=gen).tolist(), [1] * bucket, 8, gen)
        fb = step.batch
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc", "positions"):
            getattr(static, name).copy_(getattr(fb, name))
        static.seq_lens_cpu.copy_(fb.seq_lens_cpu)
        q.copy_(step.q), k.copy_(step.k), v.copy_(step.v)
        backend.init_forward_metadata_out_graph(static)
        graph.replay()
        expected = reference_attention(step.q, step.k, step.v, *kv.pool.get_kv(0), kv.req_to_token, step.rows,
                                       step.prefix_lens, step.extend_lens, scaling=layer.scaling, sliding_window=9)
        assert max_rel_error(out, expected) < 1e-2, f"trial {trial}"
        for row in step.rows:
            kv.free_request(row)
