"""Constructor argument checks shared by AttentionLayer and the KV cache classes.

Each helper returns the value (as the right Python type) or raises InvalidConfigError naming the owner,
the argument, the bad value and what is accepted. They run once per object, never per step.
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch

from compile_attn.errors import InvalidConfigError

# KV pool dtypes some backend reads: torch_native any of them, triton fp16/bf16/fp32/fp8, flashinfer fp16/bf16/fp8.
KV_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_int(owner: str, name: str, value: object) -> int:
    """``value`` as an int > 0, else InvalidConfigError."""
    if not _is_int(value) or int(value) <= 0:
        raise InvalidConfigError(f"{owner}: {name} must be a positive int, got {value!r}")
    return int(value)


def non_negative_int(owner: str, name: str, value: object) -> int:
    """``value`` as an int >= 0, else InvalidConfigError."""
    if not _is_int(value) or int(value) < 0:
        raise InvalidConfigError(f"{owner}: {name} must be an int >= 0, got {value!r}")
    return int(value)


def finite_float(owner: str, name: str, value: object, *, positive: bool, hint: str = "") -> float:
    """``value`` as a finite float, > 0 when ``positive`` else >= 0; InvalidConfigError for NaN, inf, the wrong
    sign or a non-number."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    if ok:
        ok = float(value) > 0 if positive else float(value) >= 0
    if not ok:
        want = "a finite float > 0" if positive else "a finite float >= 0"
        raise InvalidConfigError(f"{owner}: {name} must be {want}, got {value!r}{'; ' + hint if hint else ''}")
    return float(value)


def kv_dtype(owner: str, dtype: object) -> torch.dtype:
    """``dtype`` if the KV pool can hold it, else InvalidConfigError listing the supported dtypes."""
    if dtype not in KV_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in KV_DTYPES)
        raise InvalidConfigError(
            f"{owner}: KV cache dtype {dtype} is not supported; supported: {names} (quantised integer KV is not)"
        )
    return dtype  # type: ignore[return-value]


def renamed_keywords(owner: str, given: dict[str, object], renames: dict[str, str]) -> dict[str, object]:
    """``given`` (old keyword -> value) mapped to the new names of ``renames`` (old -> new), with one
    DeprecationWarning per old name used; TypeError for a keyword that is neither."""
    out: dict[str, object] = {}
    for old, value in given.items():
        if old not in renames:
            raise TypeError(f"{owner}() got an unexpected keyword argument {old!r}")
        new = renames[old]
        warnings.warn(f"{owner}({old}=...) is deprecated; pass {new}=...", DeprecationWarning, stacklevel=3)
        out[new] = value
    return out
