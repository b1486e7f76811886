"""One-launch decode as a programmatic dependent launch (PDL) between Inductor kernels that are PDL launches too.

The query comes from a kernel compiled with ``triton.enable_pdl`` right before the decode, and a kernel compiled
the same way reads the output right after it, all in one CUDA graph replayed with new inputs: a decode that read
its query before the producer finished, or a consumer that read the output before the decode finished, would
show as a mismatch against the float64 reference. Needs a GPU of compute capability 9.0+."""

from __future__ import annotations

import math

import pytest
import torch
from tests.attention.kernels.kernel_reference import TOLERANCE, make_paged_cache, reference_attention, rel_err
from torch._inductor.utils import run_and_get_code

from compile_attn.attention.kernels import decode_attention, decode_semaphores
from compile_attn.env import PDL_ENV, pdl_turned_off
from compile_attn.attention.kernels.launch import CachedLaunch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_KV_SPLITS = 16


def _pdl_device() -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    if pdl_turned_off():
        pytest.skip(f"{PDL_ENV}=0 turns the decode kernel's dependent launch off")


def test_one_launch_decode_is_a_dependent_launch_only_with_semaphores():
    _pdl_device()
    q = torch.zeros(1, 8, 64, device="cuda")
    assert decode_attention._use_pdl(q)
    assert not decode_attention._use_pdl(q.cpu())


def test_decode_between_pdl_producer_and_consumer_in_a_graph():
    _pdl_device()
    bs, hq, hkv, d = 6, 32, 8, 64
    gen = torch.Generator().manual_seed(3)
    lengths = [513, 1, 70, 2000, 64, 129]
    cache = make_paged_cache(lengths, hkv, d, d, 1, torch.bfloat16, gen, device="cuda")
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    indices = torch.cat([cache.slots(b) for b in range(bs)]).to(torch.int32)
    splits = torch.tensor([9, 1, 2, 16, 1, 3], dtype=torch.int32, device="cuda")
    logits = torch.empty(bs, hq, MAX_KV_SPLITS, d, device="cuda")
    lse = torch.empty(bs, hq, MAX_KV_SPLITS, device="cuda")
    semaphores = decode_semaphores(bs, hq, "cuda")
    x = torch.zeros(bs, hq, d, dtype=torch.bfloat16, device="cuda")
    scale = torch.randn(d, generator=gen).to("cuda", torch.bfloat16)
    out = torch.empty(bs, hq, d, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(d, generator=gen).to("cuda")

    with torch._inductor.config.patch({"triton.enable_pdl": True, "force_disable_caches": True}):
        produce = torch.compile(lambda x: (x.float() * scale.float()).sin().to(torch.bfloat16), dynamic=False)
        consume = torch.compile(lambda o: (o.float() * weight).sum(-1), dynamic=False)
        q, code_p = run_and_get_code(produce, x)
        _, code_c = run_and_get_code(consume, out)
    assert "gdc_wait" in code_p[0] and "gdc_wait" in code_c[0]

    launches = []
    original = CachedLaunch.__call__

    def recording(self, grid, *args, **kwargs):  # noqa: ANN001, ANN202
        launches.append(kwargs.get("launch_pdl", False))
        return original(self, grid, *args, **kwargs)

    def step() -> torch.Tensor:
        q = produce(x)
        decode_attention.decode_attention_fwd(q, cache.k_buffer, cache.v_buffer, out, indptr, indices, splits,
                                              MAX_KV_SPLITS, logits, lse, 1 / math.sqrt(d), semaphores=semaphores)
        return consume(out)

    CachedLaunch.__call__ = recording
    try:
        step()
    finally:
        CachedLaunch.__call__ = original
    assert launches == [True], launches
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reduced = step()

    for i in range(3):
        x.copy_(torch.randn(x.shape, generator=gen).to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        q = (x.float() * scale.float()).sin().to(torch.bfloat16)
        for b in range(bs):
            slots = cache.slots(b)
            allowed = torch.ones(1, len(slots), dtype=torch.bool, device="cuda")
            ref = reference_attention(q[b : b + 1], cache.k_buffer[slots], cache.v_buffer[slots], allowed,
                                      1 / math.sqrt(d))
            assert rel_err(out[b : b + 1], ref) <= TOLERANCE[torch.bfloat16], (i, b)
        expected = (out.double() * weight.double()).sum(-1)
        torch.testing.assert_close(reduced.double(), expected, rtol=1e-3, atol=1e-3)
        assert not semaphores.any()
