"""``torch.ops.compile_attn.gemv``: a linear layer of one input row, as one Triton matrix-vector kernel.

``gemv(x, weight, bias)`` equals ``F.linear(x, weight, bias)`` for an ``x`` whose leading dimensions hold one row
(``x.numel() == in_features``), accumulated in fp32 and rounded once. The one-token compiles
(``compiler/compile_sizes.py``) put it in place of every one-row linear layer: the layer is bound by reading its
weight, and the kernel (``ops/gemv_kernel.py``) reads it closer to the memory bandwidth than cuBLAS or Inductor's
own reduction does (``benchmarks/sweep_gemv.py``). Where the Triton kernel cannot run (a CPU tensor outside the
Triton interpreter, a weight not contiguous along its rows), the op is ``F.linear``. ``linear`` is the eager
entry: the LM head on the sampled rows takes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compile_attn.env import gemv_kernel

_LIB = torch.library.Library("compile_attn", "FRAGMENT")  # noqa: TOR901 - kept alive for the process
_LIB.define("gemv(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or x.numel() != weight.shape[1]:
        raise ValueError(f"compile_attn.gemv takes one input row of weight.shape[1] values: x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}; use F.linear for more rows")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"compile_attn.gemv: bias of shape {tuple(bias.shape)} for weight {tuple(weight.shape)}")


def _kernel_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if weight.stride(1) != 1:
        return False
    if x.is_cuda:
        return True
    from compile_attn.ops.gemv_kernel import _gemv_kernel
    from compile_attn.ops.triton_launch import is_interpreted

    return is_interpreted(_gemv_kernel)  # CPU tensors under TRITON_INTERPRET=1


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one input row, fp32 accumulation, one rounding to ``x.dtype``."""
    _check(x, weight, bias)
    if not _kernel_runs(x, weight):
        return F.linear(x, weight, bias)
    from compile_attn.ops.gemv_kernel import launch_gemv

    out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    launch_gemv(x.reshape(-1).contiguous(), weight, bias, out.view(-1))
    return out


_LIB.impl("gemv", gemv, "CompositeExplicitAutograd")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for eager callers (the LM head on the sampled rows): one input row on a GPU goes through the gemv
    kernel (unless ``COMPILE_ATTN_GEMV_KERNEL=0``; the op itself takes ``F.linear`` for a weight the kernel cannot
    read), anything else through ``F.linear``."""
    if x.is_cuda and x.numel() == x.shape[-1] and gemv_kernel():
        return torch.ops.compile_attn.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


@torch.library.register_fake("compile_attn::gemv", lib=_LIB)
def _gemv_fake(x, weight, bias=None):  # noqa: ANN001, ANN202
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
