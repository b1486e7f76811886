"""Helpers shared by the Triton kernel families: argument checks, dtype mapping, soft-capping and the fp8 KV
store's quantisation (``quantize_fp8``). Whether a kernel runs interpreted and whether a GPU takes programmatic
dependent launches is ``ops/triton_launch.py``'s.

Nothing here launches a kernel or allocates device memory; every check looks at shapes, dtypes and
devices only, so callers stay free of host syncs (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compile_attn.ops.triton_launch import is_interpreted

SUPPORTED_HEAD_DIMS: tuple[int, ...] = (64, 96, 128, 192, 256)
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
# KV caches of these dtypes hold ``real / scale`` (per KV head float32 scales for K and for V, passed to every kernel
# that reads or writes them); the kernels fold the scales into their dot products.
FP8_KV_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
SUPPORTED_KV_DTYPES: tuple[torch.dtype, ...] = SUPPORTED_DTYPES + FP8_KV_DTYPES


def check_supported(head_dim: int, v_head_dim: int, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` naming the first unsupported value, what is supported, and the way out. ``dtype`` is the
    KV cache's (queries and outputs are fp16, bf16 or fp32; an fp8 cache comes with per-head scales)."""
    dims = ", ".join(str(d) for d in SUPPORTED_HEAD_DIMS)
    for name, value in (("head_dim", head_dim), ("v_head_dim", v_head_dim)):
        if value not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"{name} {value} is not supported by the triton attention kernels; supported: {dims}; "
                "use backend='torch_native'"
            )
    if dtype not in SUPPORTED_KV_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_KV_DTYPES)
        raise ValueError(
            f"dtype {dtype} is not supported by the triton attention kernels; supported: {names}; "
            "use backend='torch_native'"
        )


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


# ------------------------------------------------------------------------------------------------ fp8 KV
def kv_fp8_constexprs(kernel, kv_dtype: torch.dtype) -> dict:
    """The constexprs a kernel that stores into a KV cache of ``kv_dtype`` takes: ``KV_FP8`` (quantise, and fold
    the scales in), ``FP8_MAX`` (the format's largest finite value, the saturation bound) and ``FP8_EMULATE``
    (round to the fp8 grid by arithmetic before the cast: interpreted kernels only, see :func:`quantize_fp8`)."""
    fp8 = kv_dtype in FP8_KV_DTYPES
    return dict(KV_FP8=fp8, FP8_MAX=float(torch.finfo(kv_dtype).max) if fp8 else 0.0,
                FP8_EMULATE=fp8 and is_interpreted(kernel))


def check_kv_scales(k_buffer: torch.Tensor, v_buffer: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> bool:
    """Whether the cache is fp8 (then ``k_scale``/``v_scale`` must be float32 ``[num_kv_heads]`` on its device);
    scales given with an unquantised cache are an error too, since nothing would read them."""
    fp8 = k_buffer.dtype in FP8_KV_DTYPES
    if v_buffer.dtype != k_buffer.dtype:
        raise ValueError(f"k_buffer is {k_buffer.dtype} but v_buffer is {v_buffer.dtype}; a KV cache has one dtype")
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale were given for a {k_buffer.dtype} KV cache; only fp8 caches "
                             f"({', '.join(str(d) for d in FP8_KV_DTYPES)}) are scaled")
        return False
    num_kv_heads = k_buffer.shape[1]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"a {k_buffer.dtype} KV cache needs {name} (float32 [num_kv_heads]: stored = real / "
                             f"scale); pass the pool's kv_scales(layer_id)")
        if s.dtype != torch.float32 or tuple(s.shape) != (num_kv_heads,) or s.device != k_buffer.device:
            raise ValueError(f"{name} must be float32 of shape ({num_kv_heads},) on {k_buffer.device}, got "
                             f"{s.dtype} {tuple(s.shape)} on {s.device}")
    return True


@triton.jit
def _round_to_fp8_grid(x, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """``x`` (fp32, within the format's range) rounded to the nearest fp8 value, ties to even, by arithmetic:
    the spacing of fp8 values around |x| is 2^(max(exponent(x), MIN_EXP) - MANT_BITS) (below the smallest normal
    exponent the subnormals keep that exponent's spacing), and adding then subtracting 1.5 * 2^23 rounds an fp32 of
    magnitude < 2^22 to an integer, ties to even (and to +0, hence the sign's repair)."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, MIN_EXP)
    ulp = ((exponent - MANT_BITS + 127) << 23).to(tl.float32, bitcast=True)
    steps = (x / ulp + 12582912.0) - 12582912.0
    return tl.where(steps == 0.0, x * 0.0, steps * ulp)  # x * 0: what rounds to zero keeps its sign


@triton.jit
def quantize_fp8(x, scale, FP8_MAX: tl.constexpr, FP8_EMULATE: tl.constexpr):
    """``x / scale`` in fp32, saturated to +-``FP8_MAX`` (never inf or NaN), as ``kv/fp8.py``'s ``quantize``; the
    caller casts to the cache's fp8 dtype. Compiled, that cast rounds to nearest even (the GPU's saturating fp8
    conversion). ``FP8_EMULATE`` (interpreted kernels): the interpreter's fp32 -> fp8 cast rounds ties away and
    drops the carry into the exponent (values just below a power of two come out halved), so the value is put on
    the fp8 grid here first, which leaves the cast exact."""
    y = tl.math.div_rn(x.to(tl.float32), scale)  # IEEE division, as torch: "/" compiles to an approximate one
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if FP8_EMULATE:
        if FP8_MAX == 448.0:  # e4m3fn: 3 mantissa bits, smallest normal exponent -6
            y = _round_to_fp8_grid(y, 3, -6)
        else:  # e5m2: 2 mantissa bits, smallest normal exponent -14
            y = _round_to_fp8_grid(y, 2, -14)
    return y


@triton.jit
def fp8_kv_query(q):
    """``q`` as the decode kernels' dots over an fp8 cache take it. fp32 stays (IEEE dots over keys converted to
    fp32). A 16-bit query becomes fp16: both fp8 formats convert to fp16 exactly with one instruction per pair of
    elements, where bf16 takes one more per element, and decode's per-byte work is what an fp8 cache must keep
    small. Saturated at fp16's largest finite value (a query element beyond 65504 does not occur in practice;
    saturating keeps the scores finite if one did); elements below fp16's normal range (6e-5) lose precision
    relative to themselves, not to the dot product."""
    if q.dtype == tl.float32:
        return q
    else:
        return tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
