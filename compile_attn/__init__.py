"""compile_attn: LLM attention as a first-class citizen of PyTorch's compiler stack.

Public API only; see the submodules for the pieces (ops, attention backends, KV cache, batches).
"""

from compile_attn import ops  # noqa: F401  (registers torch.ops.compile_attn.*)
from compile_attn.attention import (
    AttentionBackend,
    available_backends,
    create_backend,
    installed_backends,
    register_backend,
)
from compile_attn.batch import ForwardBatch, ForwardMode
from compile_attn.config import GraphConfig
from compile_attn.context import ForwardContext, forward_context, get_forward_context, has_forward_context
from compile_attn.engine import LLM, CompletionOutput, RequestOutput, RequestTooLargeError, SamplingParams
from compile_attn.errors import (
    BackendUnavailableError,
    CompileAttnError,
    GraphReplayError,
    InvalidBatchError,
    InvalidConfigError,
    KVCacheExhaustedError,
    NoForwardContextError,
    UnknownBackendError,
    UnsupportedConfigError,
)
from compile_attn.kv_cache import PAD_REQUEST, PAD_SLOT, KVCache, PagedKVPool, PageAllocator, ReqToTokenPool
from compile_attn.graph_mode import GraphMode
from compile_attn.layer import AttentionLayer
from compile_attn.ops import register_split_op
from compile_attn.version import __version__ as __version__

# The compile backend pulls in torch._dynamo: load it only when one of its names is used.
_COMPILER_NAMES = {"compile_counters", "clear_cache", "compile_attn_backend"}


def __getattr__(name: str):  # noqa: ANN202
    if name in _COMPILER_NAMES:
        import compile_attn.compiler as _compiler

        return getattr(_compiler, name)
    raise AttributeError(f"module 'compile_attn' has no attribute {name!r}")

__all__ = [
    "PAD_REQUEST",
    "PAD_SLOT",
    "AttentionBackend",
    "AttentionLayer",
    "BackendUnavailableError",
    "CompileAttnError",
    "ForwardBatch",
    "ForwardContext",
    "ForwardMode",
    "GraphReplayError",
    "GraphConfig",
    "GraphMode",
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "RequestTooLargeError",
    "SamplingParams",
    "InvalidBatchError",
    "InvalidConfigError",
    "KVCache",
    "KVCacheExhaustedError",
    "NoForwardContextError",
    "PageAllocator",
    "PagedKVPool",
    "ReqToTokenPool",
    "UnknownBackendError",
    "UnsupportedConfigError",
    "available_backends",
    "create_backend",
    "forward_context",
    "get_forward_context",
    "has_forward_context",
    "installed_backends",
    "register_backend",
    "register_split_op",
]

import importlib.util as _importlib_util  # noqa: E402 - after __all__, with the optional integration below

if _importlib_util.find_spec("transformers") is not None:  # HF integration: attn_implementation="compile_attn"
    try:
        import compile_attn.hf  # noqa: F401  (registers with transformers' AttentionInterface)
    except ImportError as _exc:  # transformers older than 5
        import logging as _logging

        _logging.getLogger(__name__).warning("compile_attn.hf not loaded (needs transformers>=5): %s", _exc)
