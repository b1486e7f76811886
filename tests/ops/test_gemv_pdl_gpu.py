"""The gemv kernel as a programmatic dependent launch (PDL) inside a CUDA graph, between kernels that are PDL
launches too: an Inductor kernel compiled with ``triton.enable_pdl`` writes the input row, two gemv launches follow
one another (the second reads the first's output), and an Inductor PDL kernel reads the result. The graph is
replayed with new inputs; a gemv that read its input row before the producer finished, or a consumer that read
before the gemv finished, shows as a mismatch against the float64 reference. Needs compute capability 9.0+."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from compile_attn.env import PDL_ENV, pdl_turned_off
from compile_attn.ops.gemv_kernel import launch_gemv, use_pdl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _pdl_device() -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0+")
    if pdl_turned_off():
        pytest.skip(f"{PDL_ENV}=0 turns the dependent launches off")


def test_gemv_is_a_dependent_launch_on_the_gpu_only() -> None:
    _pdl_device()
    assert use_pdl(torch.zeros(4, device="cuda"))
    assert not use_pdl(torch.zeros(4))


@pytest.mark.parametrize("k", [4096, 1000])  # whole 512-value steps, and a ragged last step
def test_gemv_chain_between_pdl_kernels_in_a_graph(k: int) -> None:
    _pdl_device()
    gen = torch.Generator().manual_seed(k)
    n1, n2 = 8192, 2048
    w1 = (torch.randn(n1, k, generator=gen) / k**0.5).to("cuda", torch.bfloat16)
    w2 = (torch.randn(n2, n1, generator=gen) / n1**0.5).to("cuda", torch.bfloat16)
    scale = torch.randn(k, generator=gen).to("cuda", torch.bfloat16)
    weight = torch.randn(n2, generator=gen).to("cuda")
    x = torch.zeros(k, dtype=torch.bfloat16, device="cuda")
    y1 = torch.empty(n1, dtype=torch.bfloat16, device="cuda")
    y2 = torch.empty(n2, dtype=torch.bfloat16, device="cuda")

    with torch._inductor.config.patch({"triton.enable_pdl": True, "force_disable_caches": True}):
        produce = torch.compile(lambda x: (x.float() * scale.float()).sin().to(torch.bfloat16), dynamic=False)
        consume = torch.compile(lambda y: (y.float() * weight).sum(-1), dynamic=False)
        _, code_p = run_and_get_code(produce, x)
        _, code_c = run_and_get_code(consume, y2)
    assert "gdc_wait" in code_p[0] and "gdc_wait" in code_c[0]

    def step() -> torch.Tensor:
        row = produce(x)
        launch_gemv(row, w1, None, y1)
        launch_gemv(y1, w2, None, y2)
        return consume(y2)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reduced = step()

    for i in range(3):
        x.copy_(torch.randn(k, generator=gen).to(torch.bfloat16))
        y1.fill_(float("nan"))
        y2.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        row = (x.float() * scale.float()).sin().to(torch.bfloat16)
        ref1 = w1.double() @ row.double()
        torch.testing.assert_close(y1.double(), ref1, rtol=0, atol=ref1.abs().max().item() * 2.0**-7 + 1e-3)
        ref2 = w2.double() @ y1.double()  # from the rounded first output, as the second launch reads it
        torch.testing.assert_close(y2.double(), ref2, rtol=0, atol=ref2.abs().max().item() * 2.0**-7 + 1e-3)
        expected = (y2.double() * weight.double()).sum(-1)
        torch.testing.assert_close(reduced.double(), expected, rtol=1e-3, atol=1e-3, msg=f"replay {i}")
