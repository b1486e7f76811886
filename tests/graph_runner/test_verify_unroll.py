"""A chain verify batch replays through the full decode graph of its token count: its decode-shaped twin's attention
equals the verify batch's own (run as an extend) on random batches, and the runner routes it to a full graph."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_attn import ForwardBatch, ForwardMode, KVCache, create_backend
from compile_attn.graph_runner.verify_unroll import is_chain_verify, unroll_chain_verify
from compile_attn.layer import AttentionLayer

HQ, HKV, D = 4, 2, 64  # a head size every backend runs


@pytest.mark.parametrize("name", ["torch_native", "triton"])
@settings(max_examples=12, deadline=None)
@given(prefixes=st.lists(st.integers(1, 20), min_size=1, max_size=3), draft=st.integers(1, 4),
       page_size=st.sampled_from([1, 4]), seed=st.integers(0, 2**16))
def test_unrolled_decode_rows_attend_like_the_verify_batch(name: str, prefixes: list[int], draft: int,
                                                           page_size: int, seed: int) -> None:
    """Each backend's decode of the unrolled rows (triton after ``store_decode_kv_first``, as the engine sets it)
    against torch_native's extend of the verify batch."""
    gen = torch.Generator().manual_seed(seed)
    kv = KVCache(num_layers=1, num_kv_heads=HKV, head_dim=D, max_batch_size=len(prefixes), max_context=32,
                 kv_cache_tokens=256, page_size=page_size, dtype=torch.float32)
    layer = AttentionLayer(layer_id=0, num_heads=HQ, num_kv_heads=HKV, head_dim=D)
    backend = create_backend("torch_native", kv, [layer])
    tested = create_backend(name, kv, [layer])
    assert tested.store_decode_kv_first() and tested.decode_stores_kv_first
    rows = [kv.alloc_request() for _ in prefixes]
    k_buf, v_buf = kv.pool.get_kv(0)
    loc = kv.alloc_extend(rows, prefixes)  # the cached prefixes, random K/V
    k_buf[loc], v_buf[loc] = torch.randn(len(loc), HKV, D, generator=gen), torch.randn(len(loc), HKV, D, generator=gen)
    n = draft + 1
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=prefixes, extend_lens=[n] * len(rows),
                            out_cache_loc=kv.alloc_extend(rows, [n] * len(rows)),
                            forward_mode=ForwardMode.TARGET_VERIFY)
    assert is_chain_verify(fb)
    t = fb.num_tokens
    q = torch.randn(t, HQ, D, generator=gen)
    k, v = torch.randn(t, HKV, D, generator=gen), torch.randn(t, HKV, D, generator=gen)
    want = torch.empty(t, HQ, D)
    backend.init_forward_metadata(fb)
    backend.forward(q, k, v, layer, fb, want)
    unrolled = unroll_chain_verify(fb)
    assert unrolled.forward_mode is ForwardMode.DECODE and unrolled.batch_size == t
    assert unrolled.seq_lens.tolist() == [p + j + 1 for p in prefixes for j in range(n)]
    assert unrolled.req_pool_indices.tolist() == [r for r in rows for _ in range(n)]
    got = torch.full((t, HQ, D), float("nan"))
    tested.init_cuda_graph_state(t, t)
    unrolled.graph_bucket = t  # as the runner's decode view is (views are not checked: the rows repeat)
    tested.init_forward_metadata_out_graph(unrolled)
    tested.init_forward_metadata_in_graph(unrolled)
    tested.forward(q, k, v, layer, unrolled, got)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_runner_replays_chain_verify_steps_in_full_decode_graphs() -> None:
    from compile_attn.engine import LLM, SamplingParams
    from compile_attn.models import ToyDecoder, ToyDecoderConfig

    torch.manual_seed(0)
    model = ToyDecoder(ToyDecoderConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                        head_dim=8, intermediate_size=64)).eval()
    llm = LLM(model, max_batch_size=4, max_num_tokens=24, kv_cache_tokens=256, max_context=64, page_size=4,
              graph_mode="full", compile=False, device="cpu",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert llm.step_runner.runner.decode_buckets[-1] == 16  # 4 requests x (1 + 3) rows
    prompts = [[(7 * i + j) % 11 for j in range(n)] for i, n in enumerate([3, 17, 9, 30])]
    llm.generate(prompts, SamplingParams(max_new_tokens=12))
    runs, modes = llm.step_runner.runner.stats.runs, llm.steps_by_mode
    assert modes[ForwardMode.TARGET_VERIFY] > 0
    assert runs["full"] == modes[ForwardMode.DECODE] + modes[ForwardMode.TARGET_VERIFY]


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_only_verify_batches_are_chains(mode: ForwardMode) -> None:
    kv = KVCache(num_layers=1, num_kv_heads=HKV, head_dim=D, max_batch_size=1, max_context=8, kv_cache_tokens=16)
    row = kv.alloc_request()
    kv.alloc_extend([row], [3])
    fb = ForwardBatch.build(req_pool_indices=[row], prefix_lens=[3], extend_lens=[1],
                            out_cache_loc=kv.alloc_extend([row], [1]), forward_mode=mode)
    assert not is_chain_verify(fb)


def test_backends_whose_decode_kernel_stores_each_row_take_the_extend_route() -> None:
    """The triton decode kernel stores each row's new token itself, so a row could read another row's slot of the
    same request before it is written: chain verify steps take the extend route there (and in a hybrid decoding
    with triton) until ``store_decode_kv_first()``; the backends that store first replay decode graphs."""
    from compile_attn.attention.hybrid import HybridBackend
    from compile_attn.attention.torch_native.backend import TorchNativeBackend
    from compile_attn.attention.triton.backend import TritonBackend

    assert TorchNativeBackend.decode_stores_kv_first and not TritonBackend.decode_stores_kv_first
    kv = KVCache(num_layers=1, num_kv_heads=HKV, head_dim=D, max_batch_size=1, max_context=8, kv_cache_tokens=16)
    layers = [AttentionLayer(layer_id=0, num_heads=HQ, num_kv_heads=HKV, head_dim=D)]
    assert HybridBackend(kv, layers, prefill="torch_native", decode="torch_native").decode_stores_kv_first
    hybrid = HybridBackend(kv, layers, prefill="torch_native", decode="triton")
    assert not hybrid.decode_stores_kv_first
    assert hybrid.store_decode_kv_first() and hybrid.decode_stores_kv_first and hybrid.decode.decode_stores_kv_first
