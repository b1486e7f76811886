"""Every backend takes k/v as strided views of a fused q/k/v projection's output.

The HF attention function hands the op ``value`` as it comes out of the (fused) projection: a view whose
token stride is the whole q|k|v row, not a copy (a copy is one more kernel per layer in every graph). Each
backend must store such k/v to the pool and attend over them exactly as over contiguous tensors: checked
against the float64 reference on decode and mixed batches, with the pool writes compared bit for bit.
"""

from __future__ import annotations


import pytest
import torch

from compile_attn import ForwardMode

from tests.triton_backend.tb_helpers import TOL, Case, run_case  # noqa: E402

DECODE = Case((5, 33, 70, 17), (1, 1, 1, 1), group=4, page_size=16)
MIXED = Case((9, 0, 31, 16), (1, 13, 1, 6), group=4, page_size=16, mode=ForwardMode.MIXED)
GPU_BACKENDS = {"torch_native": None, "triton": "triton", "flashinfer": "flashinfer", "fa3": "sgl_kernel"}  # -> package


def _check(backend: str, case: Case, device: str, dtype: torch.dtype) -> None:
    for result in run_case(case, device, dtype, strided=True, backend_name=backend):
        assert result.error < TOL[dtype], f"{backend}: relative error {result.error:.2e}"


@pytest.mark.parametrize("case", [DECODE, MIXED], ids=["decode", "mixed"])
def test_torch_native_takes_strided_kv(case: Case) -> None:
    _check("torch_native", case, "cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_backends_take_strided_kv(backend: str, case: Case) -> None:
    if GPU_BACKENDS[backend]:
        pytest.importorskip(GPU_BACKENDS[backend])
    _check(backend, case, "cuda", torch.bfloat16)
