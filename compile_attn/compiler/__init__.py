"""The compile backend ``torch.compile(model, backend="compile_attn")``: split, compile, piecewise graphs.

Importing this package registers the backend name for processes where compile_attn is not installed
(installed, Dynamo finds it through the ``torch_dynamo_backends`` entry point without any import).
"""

from __future__ import annotations

from compile_attn.compiler.backend import compile_attn_backend, resolve_config
from compile_attn.compiler.cache import clear_cache
from compile_attn.compiler.counters import CompileCounters, compile_counters
from compile_attn.env import DEBUG_DIR_ENV

BACKEND_NAME = "compile_attn"


def _register_backend_name() -> None:
    """Register ``"compile_attn"`` with Dynamo unless the entry point (or an earlier import) already did."""
    from torch._dynamo import list_backends
    from torch._dynamo.backends.registry import register_backend

    if BACKEND_NAME not in list_backends(exclude_tags=()):
        register_backend(compile_attn_backend, name=BACKEND_NAME)


_register_backend_name()

__all__ = [
    "BACKEND_NAME",
    "DEBUG_DIR_ENV",
    "CompileCounters",
    "clear_cache",
    "compile_attn_backend",
    "compile_counters",
    "resolve_config",
]
