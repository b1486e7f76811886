"""Attention backends: the AttentionBackend interface, the registry, and the backends themselves.

Backends with optional dependencies (triton, flashinfer, fa3) are imported only when created.
"""

from compile_attn.attention.base import TREE_VERIFY_BACKENDS, AttentionBackend
from compile_attn.attention.registry import (
    available_backends,
    check_backend_installed,
    check_backend_name,
    create_backend,
    get_backend_class,
    installed_backends,
    register_backend,
    resolve_auto_backend,
)
from compile_attn.attention.torch_native import backend as _torch_native  # noqa: F401  (registers "torch_native")

__all__ = [
    "TREE_VERIFY_BACKENDS",
    "AttentionBackend",
    "available_backends",
    "check_backend_installed",
    "check_backend_name",
    "create_backend",
    "get_backend_class",
    "installed_backends",
    "register_backend",
    "resolve_auto_backend",
]
