"""FP8 KV storage: what a quantised pool holds and how it maps back to real values.

A pool of dtype ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` stores ``x / scale`` saturated to the format's
largest finite value (never NaN or inf), with one float32 scale per layer and KV head for K and for V
(``PagedKVPool.kv_scales``); a value is read back as ``stored.float() * scale``. Kernels fold the scale into their
dot products; this module is the reference they are tested against.
"""

from __future__ import annotations

import torch

FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 ``dtype`` (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x[T, Hkv, D] / scale[Hkv]`` saturated to ``dtype``'s range and cast (graph-capturable)."""
    limit = fp8_max(dtype)
    return (x.float() / scale[:, None]).clamp_(-limit, limit).to(dtype)


def dequantize(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Real values (float32) of ``stored[..., Hkv, D]`` with per-head ``scale[Hkv]``."""
    return stored.float() * scale[:, None]
