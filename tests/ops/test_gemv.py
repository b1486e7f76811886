"""``torch.ops.compile_attn.gemv`` (the one-row linear) against a float64 reference: the Triton kernel at every tile
shape it may take (CPU under ``TRITON_INTERPRET=1``, small sizes; the GPU at the model sizes it serves), with and
without bias, ragged N and K; the torch fallback; the fake implementation under ``torch.compile``; bad inputs."""

from __future__ import annotations

import pytest
import torch

import compile_attn  # noqa: F401  (registers the op)
from compile_attn.ops.gemv import linear
from compile_attn.ops.gemv_kernel import GemvConfig, gemv_config, launch_gemv


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.reshape(1, -1).double() @ w.double().T
    return (y + b.double() if b is not None else y).view(-1)


def _bf16_tol(ref: torch.Tensor) -> float:
    # one rounding of the fp32 sum to bf16 (8 bits of mantissa) plus fp32 accumulation noise
    return ref.abs().max().item() * 2.0**-7 + 1e-3


@pytest.mark.parametrize("n,k", [(1, 16), (33, 100), (64, 512), (7, 1030), (130, 256)])
@pytest.mark.parametrize("config", [None, GemvConfig(1, 256, 4, 1), GemvConfig(4, 128, 4, 1), GemvConfig(16, 64, 2, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_float64(n: int, k: int, config: GemvConfig | None, bias: bool) -> None:
    torch.manual_seed(n * 1000 + k)
    x = torch.randn(k, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16) / k**0.5
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    out = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    launch_gemv(x, w, b, out, config)
    ref = _reference(x, w, b)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=_bf16_tol(ref))


def test_kernel_reads_a_row_strided_weight() -> None:
    """A weight that is a row slice of a wider one (stride(0) > K): each row read at its own offset."""
    torch.manual_seed(1)
    wide = torch.randn(24, 96, dtype=torch.float32)
    w = wide[:, :80]
    x = torch.randn(80, dtype=torch.float32)
    out = torch.empty(24, dtype=torch.float32)
    launch_gemv(x, w, None, out, GemvConfig(8, 32, 2, 1))
    torch.testing.assert_close(out.double(), _reference(x, w, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 48), (1, 1, 48), (48,)])
def test_op_keeps_leading_dims(shape: tuple[int, ...]) -> None:
    torch.manual_seed(2)
    x = torch.randn(shape, dtype=torch.float32)
    w = torch.randn(20, 48, dtype=torch.float32)
    b = torch.randn(20, dtype=torch.float32)
    y = torch.ops.compile_attn.gemv(x, w, b)
    assert y.shape == (*shape[:-1], 20) and y.dtype == x.dtype
    torch.testing.assert_close(y.reshape(-1).double(), _reference(x, w, b), rtol=1e-5, atol=1e-5)


def test_op_falls_back_to_f_linear_for_a_column_strided_weight() -> None:
    torch.manual_seed(3)
    w = torch.randn(48, 20, dtype=torch.float32).T  # stride(1) != 1: not the kernel's layout
    x = torch.randn(1, 48, dtype=torch.float32)
    y = torch.ops.compile_attn.gemv(x, w)
    torch.testing.assert_close(y.reshape(-1).double(), _reference(x, w, None), rtol=1e-5, atol=1e-5)


def test_op_compiles_without_graph_breaks() -> None:
    torch.manual_seed(4)
    x, w = torch.randn(1, 32), torch.randn(16, 32)
    fn = torch.compile(lambda x, w: torch.ops.compile_attn.gemv(x, w) * 2, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(x, w).reshape(-1).double(), 2 * _reference(x, w, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_shape,w_shape,b_shape,match", [
    ((2, 32), (16, 32), None, "one input row"),
    ((1, 31), (16, 32), None, "one input row"),
    ((1, 32), (16, 32), (15,), "bias"),
])
def test_op_names_a_bad_shape(x_shape, w_shape, b_shape, match) -> None:  # noqa: ANN001
    b = torch.zeros(b_shape) if b_shape else None
    with pytest.raises(ValueError, match=match):
        torch.ops.compile_attn.gemv(torch.zeros(x_shape), torch.zeros(w_shape), b)


@pytest.mark.parametrize("n,k", [(3072, 2048), (128256, 2048), (1536, 4096), (16, 8), (4096, 1000)])
def test_config_reads_whole_rows_in_aligned_steps(n: int, k: int) -> None:
    """The picked tile: one output per program, a K step that is a power of two no wider than K rounded up to one
    and at most 512 values."""
    config = gemv_config(n, k)
    assert config.block_n == 1
    assert config.block_k & (config.block_k - 1) == 0 and config.block_k <= min(512, 1 << (k - 1).bit_length())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (1536, 4096),
                                 (14336, 4096), (4096, 7168), (32064, 4096)])
def test_kernel_matches_float64_on_gpu(n: int, k: int) -> None:
    torch.manual_seed(5)
    x = torch.randn(k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
    b = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    launch_gemv(x, w, b, out)
    ref = _reference(x, w, b)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=_bf16_tol(ref))


def test_op_takes_a_strided_input_row() -> None:
    """An input row that is a strided view (every other value of a wider row) is read as its values."""
    torch.manual_seed(6)
    wide = torch.randn(1, 96, dtype=torch.float32)
    x = wide[:, ::2]
    w = torch.randn(12, 48, dtype=torch.float32)
    y = torch.ops.compile_attn.gemv(x, w)
    torch.testing.assert_close(y.reshape(-1).double(), _reference(x, w, None), rtol=1e-5, atol=1e-5)


def test_linear_is_f_linear_off_the_gpu() -> None:
    torch.manual_seed(7)
    x, w, b = torch.randn(1, 48), torch.randn(20, 48), torch.randn(20)
    assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x, w, b))
    x3 = torch.randn(3, 48)  # several rows: F.linear on any device
    assert torch.equal(linear(x3, w), torch.nn.functional.linear(x3, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 3])
def test_linear_matches_float64_on_gpu(rows: int) -> None:
    """One row through the kernel, several through cuBLAS: both within one bf16 rounding of the float64 product."""
    torch.manual_seed(8)
    x = torch.randn(rows, 2048, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(32064, 2048, dtype=torch.bfloat16, device="cuda") / 2048**0.5
    y = linear(x, w)
    ref = x.double() @ w.double().T
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=ref.abs().max().item() * 2.0**-7 + 1e-3)
