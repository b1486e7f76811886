"""CachedLaunch on the GPU: repeated identical launches take the short path and still read live data; a changed
argument (new buffer, new scalar) takes Triton's regular path; results match the float64 reference throughout."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_reference import TOLERANCE, make_paged_cache, reference_attention, rel_err

from compile_attn.attention.triton_ops import build_kv_indices, build_kv_indptr, compute_num_kv_splits
from compile_attn.attention.triton_ops import decode_attention as decode_module
from compile_attn.attention.triton_ops.launch import CachedLaunch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SPLITS = 8


def _reference(cache, q, scale):
    outs = []
    for b in range(q.shape[0]):
        slots = cache.slots(b)
        allowed = torch.ones(1, len(slots), dtype=torch.bool, device="cuda")
        outs.append(reference_attention(q[b : b + 1], cache.k_buffer[slots], cache.v_buffer[slots], allowed, scale))
    return torch.cat(outs)


def test_repeated_decode_takes_the_short_path_and_reads_live_data() -> None:
    gen = torch.Generator().manual_seed(7)
    lengths = [3, 200, 64, 1000]
    cache = make_paged_cache(lengths, 2, 64, 64, 1, torch.bfloat16, gen, device="cuda")
    bs, scale = len(lengths), 1 / math.sqrt(64)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    indptr = torch.empty(bs + 1, dtype=torch.int32, device="cuda")
    build_kv_indptr(seq_lens, indptr)
    indices = torch.empty(int(seq_lens.sum()), dtype=torch.int32, device="cuda")
    build_kv_indices(cache.req_to_token, cache.rows, seq_lens, indptr, indices)
    splits = compute_num_kv_splits(seq_lens, 132, SPLITS, num_kv_heads=2)
    q = torch.randn(bs, 8, 64, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty_like(q)
    logits = torch.empty(bs, 8, SPLITS, 64, device="cuda")
    lse = torch.empty(bs, 8, SPLITS, device="cuda")

    def run(scale_: float = scale) -> torch.Tensor:
        out.fill_(float("nan"))
        decode_module.decode_attention_fwd(q, cache.k_buffer, cache.v_buffer, out, indptr, indices, splits, SPLITS,
                                           logits, lse, scale_)
        return out.clone()

    launch: CachedLaunch = decode_module._LAUNCH_SPLIT
    run()
    fast = launch.fast
    first = run()
    assert launch.fast == fast + 1, "an identical second launch did not take the short path"
    assert rel_err(first, _reference(cache, q, scale)) <= TOLERANCE[torch.bfloat16]
    # same pointers, new contents: the short path reads them (nothing of the data is cached)
    q.copy_(torch.randn(bs, 8, 64, generator=gen).to(torch.bfloat16))
    cache.k_buffer.normal_()
    again = run()
    assert launch.fast == fast + 2
    assert rel_err(again, _reference(cache, q, scale)) <= TOLERANCE[torch.bfloat16]
    # a different scalar is a different key: the regular path, then correct results
    slow = launch.slow
    halved = run(scale / 2)
    assert launch.slow == slow + 1
    assert rel_err(halved, _reference(cache, q, scale / 2)) <= TOLERANCE[torch.bfloat16]


def test_cached_launch_inside_cuda_graph_capture_uses_the_capture_stream() -> None:
    gen = torch.Generator().manual_seed(8)
    lengths = [17, 300]
    cache = make_paged_cache(lengths, 2, 64, 64, 1, torch.bfloat16, gen, device="cuda")
    bs, scale = len(lengths), 1 / math.sqrt(64)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    indptr = torch.empty(bs + 1, dtype=torch.int32, device="cuda")
    build_kv_indptr(seq_lens, indptr)
    indices = torch.empty(int(seq_lens.sum()), dtype=torch.int32, device="cuda")
    build_kv_indices(cache.req_to_token, cache.rows, seq_lens, indptr, indices)
    splits = compute_num_kv_splits(seq_lens, 132, SPLITS, num_kv_heads=2)
    q = torch.randn(bs, 8, 64, generator=gen).to(torch.bfloat16).cuda()
    out = torch.zeros_like(q)
    logits = torch.empty(bs, 8, SPLITS, 64, device="cuda")
    lse = torch.empty(bs, 8, SPLITS, device="cuda")

    def step() -> None:
        decode_module.decode_attention_fwd(q, cache.k_buffer, cache.v_buffer, out, indptr, indices, splits, SPLITS,
                                           logits, lse, scale)

    step()
    step()  # cached: the capture below records short-path launches
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    q.copy_(torch.randn(bs, 8, 64, generator=gen).to(torch.bfloat16))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, _reference(cache, q, scale)) <= TOLERANCE[torch.bfloat16]
