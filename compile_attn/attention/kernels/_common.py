"""Helpers shared by the Triton kernel families: argument checks, dtype mapping, soft-capping, whether a device
takes programmatic dependent launches.

Nothing here launches a kernel or allocates device memory; every check looks at shapes, dtypes and
devices only, so callers stay free of host syncs (CUDA-graph capturable).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from compile_attn.env import pdl_turned_off

SUPPORTED_HEAD_DIMS: tuple[int, ...] = (64, 96, 128, 192, 256)
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)


def check_supported(head_dim: int, v_head_dim: int, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` naming the first unsupported value, what is supported, and the way out."""
    dims = ", ".join(str(d) for d in SUPPORTED_HEAD_DIMS)
    for name, value in (("head_dim", head_dim), ("v_head_dim", v_head_dim)):
        if value not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"{name} {value} is not supported by the triton attention kernels; supported: {dims}; "
                "use backend='torch_native'"
            )
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(
            f"dtype {dtype} is not supported by the triton attention kernels; supported: {names}; "
            "use backend='torch_native'"
        )


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (it then runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


@functools.lru_cache(maxsize=None)
def pdl_supported(device_index: int) -> bool:
    """Whether kernels on CUDA device ``device_index`` launch as programmatic dependent launches: NVIDIA compute
    capability 9.0 or newer (the ``griddepcontrol`` instructions), unless ``COMPILE_ATTN_PDL=0`` turns it off
    (read once per process)."""
    if pdl_turned_off():
        return False
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def check_device(kernel, *tensors: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors; interpreted ones (CPU tests) take CPU tensors."""
    if is_interpreted(kernel):
        return
    for t in tensors:
        if t is not None and not t.is_cuda:
            raise ValueError(
                f"triton attention kernels need CUDA tensors, got one on {t.device}; "
                "use backend='torch_native' (or TRITON_INTERPRET=1 for CPU tests)"
            )


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(t.stride())}")


def dot_precision(kernel, dtype: torch.dtype) -> str:
    """The ``DOT_PRECISION`` constexpr that :func:`mma` takes.

    fp32 inputs get IEEE dots (Triton would use tf32); fp16/bf16 ignore the setting. The
    interpreter multiplies bf16 as raw integers (and truncates fp32 -> bf16), so there the
    operands go up to fp32 instead: same function, slightly more accurate than compiled.
    """
    if dtype == torch.float32:
        return "ieee"
    if dtype == torch.bfloat16 and is_interpreted(kernel):
        return "upcast"
    return "tf32"


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@triton.jit
def mma(a, b, DOT_PRECISION: tl.constexpr):
    """``a @ b`` in fp32, ``a`` cast to ``b``'s dtype first (the probabilities of P @ V), with the
    precision chosen by :func:`dot_precision`; "upcast" keeps both operands in fp32."""
    if DOT_PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b, input_precision=DOT_PRECISION)


@triton.jit
def softcap(x, cap):
    """``cap * tanh(x / cap)``; tanh as ``1 - 2 / (exp(2y) + 1)``, which saturates cleanly in fp32."""
    y = x / cap
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))
