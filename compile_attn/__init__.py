"""compile_attn: LLM attention as a first-class citizen of PyTorch's compiler stack.

Public API only: what the README and docs tell users to call (the engine, the graph runner, the compile backend,
the HF integration, backends, the KV cache and batches). Internals (the pool, the allocator, the scratch slot) are
reached through their modules (``compile_attn.kv.cache``, ...).
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
from compile_attn.compiler import clear_cache, compile_attn_backend, compile_counters
from compile_attn.compiler.compiled_model import compile_model
from compile_attn.config import GraphConfig
from compile_attn.context import forward_context, get_forward_context, has_forward_context
from compile_attn.engine import (
    LLM,
    AsyncLLM,
    CompletionOutput,
    EngineConfig,
    GuidedDecodingParams,
    RequestOutput,
    RequestTooLargeError,
    SamplingParams,
)
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
from compile_attn.graph_mode import GraphMode
from compile_attn.graph_runner import GraphRunner
from compile_attn.kv.cache import KVCache
from compile_attn.layer import AttentionLayer
from compile_attn.ops import register_split_op
from compile_attn.version import __version__ as __version__

# The HF integration needs transformers (an optional dependency): its names load on first use.
_HF_NAMES = {"HFModelAdapter", "load_model"}


def __getattr__(name: str):  # noqa: ANN202
    if name in _HF_NAMES:
        try:
            import compile_attn.hf as _hf
        except ImportError as exc:
            raise ImportError(f"compile_attn.{name} needs transformers>=5 ({exc}); pip install 'compile-attn[hf]'") \
                from None
        return getattr(_hf, name)
    raise AttributeError(f"module 'compile_attn' has no attribute {name!r}")


__all__ = [
    "LLM",
    "AsyncLLM",
    "AttentionBackend",
    "AttentionLayer",
    "BackendUnavailableError",
    "CompileAttnError",
    "CompletionOutput",
    "EngineConfig",
    "GuidedDecodingParams",
    "ForwardBatch",
    "ForwardMode",
    "GraphConfig",
    "GraphMode",
    "GraphReplayError",
    "GraphRunner",
    "HFModelAdapter",
    "InvalidBatchError",
    "InvalidConfigError",
    "KVCache",
    "KVCacheExhaustedError",
    "NoForwardContextError",
    "RequestOutput",
    "RequestTooLargeError",
    "SamplingParams",
    "UnknownBackendError",
    "UnsupportedConfigError",
    "__version__",
    "available_backends",
    "clear_cache",
    "compile_attn_backend",
    "compile_counters",
    "compile_model",
    "create_backend",
    "forward_context",
    "get_forward_context",
    "has_forward_context",
    "installed_backends",
    "load_model",
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
