"""Import flashinfer on demand and hand back the few entry points the backend uses.

``import compile_attn`` never imports flashinfer; the backend calls ``load_flashinfer()`` when it is
created, and a missing or broken installation becomes a BackendUnavailableError that says how to
install it.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

from compile_attn.errors import BackendUnavailableError

INSTALL_HINT = 'pip install "compile-attn[flashinfer]"  (flashinfer-python>=0.5.3)'


@dataclass(frozen=True)
class FlashInferAPI:
    """The flashinfer classes and functions the backend calls (resolved once per process)."""

    version: str
    BatchDecodeWithPagedKVCacheWrapper: Any
    BatchPrefillWithPagedKVCacheWrapper: Any
    BatchPrefillWithRaggedKVCacheWrapper: Any
    merge_state_in_place: Callable[..., None]
    fast_decode_plan: Callable[..., None] | None  # flashinfer.decode.fast_decode_plan when present


def flashinfer_installed() -> bool:
    """Whether a real flashinfer package is importable (a bare directory named ``flashinfer`` on
    ``sys.path``, e.g. a test folder, is only a namespace package and does not count)."""
    try:
        spec = importlib.util.find_spec("flashinfer")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin not in (None, "namespace")


def _unavailable(reason: str) -> BackendUnavailableError:
    return BackendUnavailableError(
        f"the flashinfer attention backend needs the flashinfer package ({reason}). Install it with: "
        f"{INSTALL_HINT}; or pick another backend, e.g. create_backend('triton', ...) or 'torch_native'"
    )


def load_flashinfer() -> FlashInferAPI:
    """The flashinfer API, or BackendUnavailableError naming the install command."""
    try:
        fi = importlib.import_module("flashinfer")
    except ImportError as exc:  # not installed, or a dependency (tvm-ffi, CUDA libs) is missing
        raise _unavailable(f"importing it failed: {exc}") from exc
    if getattr(fi, "__file__", None) is None and not hasattr(fi, "BatchDecodeWithPagedKVCacheWrapper"):
        raise _unavailable(f"'flashinfer' resolves to a directory without the package: {list(fi.__path__)}")
    try:
        decode_mod = importlib.import_module("flashinfer.decode")
        fast_plan = getattr(decode_mod, "fast_decode_plan", None)
    except ImportError:
        fast_plan = None
    try:
        return FlashInferAPI(
            version=str(getattr(fi, "__version__", "unknown")),
            BatchDecodeWithPagedKVCacheWrapper=fi.BatchDecodeWithPagedKVCacheWrapper,
            BatchPrefillWithPagedKVCacheWrapper=fi.BatchPrefillWithPagedKVCacheWrapper,
            BatchPrefillWithRaggedKVCacheWrapper=fi.BatchPrefillWithRaggedKVCacheWrapper,
            merge_state_in_place=fi.merge_state_in_place,
            fast_decode_plan=fast_plan,
        )
    except AttributeError as exc:
        raise BackendUnavailableError(
            f"flashinfer {getattr(fi, '__version__', '?')} lacks {exc.name!r}; compile_attn needs "
            f"flashinfer-python>=0.5.3: {INSTALL_HINT}"
        ) from exc
