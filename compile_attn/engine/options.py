"""Checks of ``LLM(...)``'s own options (sizes, device, dtype), run before the model loads so a bad value is refused
by name in one line instead of failing deep inside loading or the first step."""

from __future__ import annotations

import torch

from compile_attn.engine.errors import EngineOptionError

# vLLM's dtype names; "auto" (or None) is bfloat16 on CUDA and float32 on the CPU.
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
               "float32": torch.float32, "float": torch.float32}


def check_sizes(**sizes: int | None) -> None:
    """Each size a positive int (None: its default), refused by name before the model loads."""
    for name, value in sizes.items():
        if value is None and name in ("max_context", "kv_cache_tokens"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise EngineOptionError(f"LLM({name}=...) must be a positive int, got {value!r}")


def check_device(device: str | torch.device | None) -> torch.device:
    """The engine's device: CUDA when present unless named; a CUDA device without CUDA is refused in one line."""
    try:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError) as exc:
        raise EngineOptionError(f"LLM(device={device!r}) is not a device ({exc}); pass 'cpu', 'cuda' or "
                                f"'cuda:N'") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise EngineOptionError(f"LLM(device={str(device)!r}) but CUDA is not available here (torch "
                                    f"{torch.__version__}); pass device='cpu', or install a CUDA build of torch")
        if device.index is not None and device.index >= count:
            raise EngineOptionError(f"LLM(device={str(device)!r}) but only {count} CUDA device(s) exist; "
                                    f"pass device='cuda:0'..'cuda:{count - 1}'")
    return device


def check_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The weights' and KV cache's dtype from a torch floating dtype or one of vLLM's names ("auto", "bfloat16",
    "float16" / "half", "float32" / "float"); "auto" and None pick bfloat16 on CUDA, float32 on the CPU."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise EngineOptionError(f"LLM(dtype={dtype!r}) is not a floating dtype; pass 'auto' (bfloat16 on CUDA, float32 "
                            f"on the CPU), {', '.join(map(repr, DTYPE_NAMES))}, or a floating torch.dtype")
