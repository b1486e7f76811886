"""Loading compile_attn's Triton kernels (``attention/kernels``) on demand, with the install command when triton is
missing; whether they were defined under the Triton interpreter.

The neutral home of what several backends need before they touch a kernel: the triton backend runs the kernels,
the flashinfer backend gathers its page ids with one. Imports triton only when called; imports no backend.
"""

from __future__ import annotations

from types import ModuleType

from compile_attn.errors import BackendUnavailableError

INSTALL_HINT = 'pip install "compile-attn[triton]"  (triton>=3.4)'


def load_triton_ops() -> ModuleType:
    """The kernel package (``attention/kernels``), or BackendUnavailableError naming the install command."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the triton attention backend needs the triton package (importing it failed: {exc}). Install it "
            f"with: {INSTALL_HINT}; or use backend='torch_native'"
        ) from exc
    from compile_attn.attention import kernels

    return kernels


def kernels_interpreted() -> bool:
    """True when the kernels were defined under ``TRITON_INTERPRET=1`` (they then run on the host)."""
    from compile_attn.ops.triton_launch import is_interpreted
    from compile_attn.attention.kernels.kv_index import _store_kv_kernel

    return is_interpreted(_store_kv_kernel)
