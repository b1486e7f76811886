"""CachedLaunch on the GPU: repeated identical launches take the short path and still read live data; a changed
argument (new buffer, new scalar) takes Triton's regular path; results match the float64 reference throughout."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from tests.attention.kernels.kernel_reference import TOLERANCE, make_paged_cache, reference_attention, rel_err

from compile_attn.attention.kernels import build_kv_indices, build_kv_indptr, compute_num_kv_splits
from compile_attn.attention.kernels import decode_attention as decode_module
from compile_attn.attention.kernels.launch import CachedLaunch
from compile_attn.env import host_shortcuts_enabled

pytestmark = [
    pytest.mark.skipif(not host_shortcuts_enabled(), reason="the short path is a host shortcut, switched off"),
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


@dataclass
class DecodeCase:
    """Static decode inputs (device-built metadata) over a random paged cache; ``run`` decodes into ``out``."""

    cache: object
    q: torch.Tensor
    out: torch.Tensor
    indptr: torch.Tensor
    indices: torch.Tensor
    splits: torch.Tensor
    logits: torch.Tensor
    lse: torch.Tensor

    @classmethod
    def make(cls, lengths: list[int], gen: torch.Generator) -> DecodeCase:
        cache = make_paged_cache(lengths, 2, 64, 64, 1, torch.bfloat16, gen, device="cuda")
        bs = len(lengths)
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        indptr = torch.empty(bs + 1, dtype=torch.int32, device="cuda")
        build_kv_indptr(seq_lens, indptr)
        indices = torch.empty(int(seq_lens.sum()), dtype=torch.int32, device="cuda")
        build_kv_indices(cache.req_to_token, cache.rows, seq_lens, indptr, indices)
        q = torch.randn(bs, 8, 64, generator=gen).to(torch.bfloat16).cuda()
        return cls(cache, q, torch.zeros_like(q), indptr, indices,
                   compute_num_kv_splits(seq_lens, 132, SPLITS, num_kv_heads=2),
                   torch.empty(bs, 8, SPLITS, 64, device="cuda"), torch.empty(bs, 8, SPLITS, device="cuda"))

    def run(self, scale: float) -> None:
        decode_module.decode_attention_fwd(self.q, self.cache.k_buffer, self.cache.v_buffer, self.out, self.indptr,
                                           self.indices, self.splits, SPLITS, self.logits, self.lse, scale)


def test_repeated_decode_takes_the_short_path_and_reads_live_data() -> None:
    gen = torch.Generator().manual_seed(7)
    case = DecodeCase.make([3, 200, 64, 1000], gen)
    cache, q, scale = case.cache, case.q, 1 / math.sqrt(64)

    def run(scale_: float = scale) -> torch.Tensor:
        case.out.fill_(float("nan"))
        case.run(scale_)
        return case.out.clone()

    launch: CachedLaunch = decode_module._LAUNCH_SPLIT
    run()
    fast = launch.fast
    first = run()
    assert launch.fast == fast + 1, "an identical second launch did not take the short path"
    assert rel_err(first, _reference(cache, q, scale)) <= TOLERANCE[torch.bfloat16]
    # same pointers, new contents: the short path reads them (nothing of the data is cached)
    q.copy_(torch.randn(*q.shape, generator=gen).to(torch.bfloat16))
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
    case = DecodeCase.make([17, 300], gen)
    cache, q, out, scale = case.cache, case.q, case.out, 1 / math.sqrt(64)

    def step() -> None:
        case.run(scale)

    step()
    step()  # cached: the capture below records short-path launches
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    q.copy_(torch.randn(*q.shape, generator=gen).to(torch.bfloat16))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, _reference(cache, q, scale)) <= TOLERANCE[torch.bfloat16]


def test_a_bound_launch_steps_aside_while_a_launch_hook_is_active() -> None:
    """With a profiler's launch hook installed a bound decode launches nothing and says so (False); the caller's
    regular launch then runs the hook. Without it, the bound launch runs again."""
    import triton

    gen = torch.Generator().manual_seed(9)
    case = DecodeCase.make([40, 700], gen)
    scale = 1 / math.sqrt(64)
    again = decode_module.decode_attention_fwd_and_bind(
        case.q, case.cache.k_buffer, case.cache.v_buffer, case.out, case.indptr, case.indices, case.splits, SPLITS,
        case.logits, case.lse, scale)
    assert again is not None
    ref = _reference(case.cache, case.q, scale)
    seen = []
    runtime = triton.knobs.runtime
    hook = runtime.launch_enter_hook
    record = seen.append
    if hasattr(hook, "add"):
        hook.add(record)
    else:
        runtime.launch_enter_hook = record
    try:
        case.out.fill_(float("nan"))
        assert again() is False
        torch.cuda.synchronize()
        assert case.out.isnan().all(), "a bound launch ran with a launch hook active"
        case.run(scale)  # the regular path, which calls the hook
        assert seen
    finally:
        if hasattr(hook, "add"):
            hook.remove(record)
        else:
            runtime.launch_enter_hook = hook
    assert rel_err(case.out, ref) <= TOLERANCE[torch.bfloat16]
    case.out.fill_(float("nan"))
    assert again() is True
    assert rel_err(case.out, ref) <= TOLERANCE[torch.bfloat16]
