"""compile_attn: LLM attention as a first-class citizen of PyTorch's compiler stack.

Public API only: what the README and docs tell users to call (the engine, the graph runner, the compile backend,
the HF integration, backends, the KV cache and batches). Internals (the pool, the allocator, the scratch slot) are
reached through their modules (``compile_attn.kv.cache``, ...).

``import compile_attn`` imports torch, the custom ops and the errors only: the other names load on first use, so the
core install (torch, numpy, tqdm) imports it and nothing heavy (Dynamo, Inductor, transformers, tokenizers, the
server) loads before it is used. tests/test_core_install.py checks both.
"""

import importlib as _importlib
import importlib.abc as _importlib_abc
import sys as _sys

from compile_attn import ops  # noqa: F401  (registers torch.ops.compile_attn.*; needs only torch)
from compile_attn.errors import (
    BackendUnavailableError,
    CompileAttnError,
    GraphReplayError,
    InvalidBatchError,
    InvalidConfigError,
    KVCacheExhaustedError,
    ModelNotFoundError,
    NoForwardContextError,
    UnknownBackendError,
    UnsupportedConfigError,
)
from compile_attn.version import __version__ as __version__

# The rest of the public API loads on first use (PEP 562): ``import compile_attn`` imports torch and the custom ops
# only, not Dynamo / Inductor (the compiler), the engine (tokenizers) or transformers (the HF integration); each
# module below is imported the first time one of its names is read. name -> the module that defines it.
_LAZY = {
    **dict.fromkeys(("AttentionBackend", "available_backends", "create_backend", "installed_backends",
                     "register_backend"), "compile_attn.attention"),
    **dict.fromkeys(("ForwardBatch", "ForwardMode"), "compile_attn.batch"),
    **dict.fromkeys(("clear_cache", "compile_attn_backend", "compile_counters"), "compile_attn.compiler"),
    "compile_model": "compile_attn.compiler.compiled_model",
    "GraphConfig": "compile_attn.config",
    **dict.fromkeys(("forward_context", "get_forward_context", "has_forward_context"), "compile_attn.context"),
    **dict.fromkeys(("LLM", "AsyncLLM", "CompletionOutput", "EngineConfig", "RequestOutput", "RequestTooLargeError",
                     "SamplingParams", "GuidedDecodingParams"), "compile_attn.engine"),
    "GraphMode": "compile_attn.graph_mode",
    "GraphRunner": "compile_attn.graph_runner",
    "KVCache": "compile_attn.kv.cache",
    "AttentionLayer": "compile_attn.layer",
    "register_split_op": "compile_attn.ops",
    **dict.fromkeys(("HFModelAdapter", "load_model"), "compile_attn.hf"),  # needs transformers: the [hf] extra
}


def __getattr__(name: str):  # noqa: ANN202
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'compile_attn' has no attribute {name!r}")
    try:
        value = getattr(_importlib.import_module(module), name)
    except ImportError as exc:
        if module != "compile_attn.hf":
            raise
        raise ImportError(f"compile_attn.{name} needs transformers>=5 ({exc}); pip install 'compile-attn[hf]'") \
            from None
    globals()[name] = value  # later reads skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
    "ModelNotFoundError",
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



# Two registrations happen after a module that ``import compile_attn`` does not import itself has loaded:
# - transformers: ``attn_implementation="compile_attn"`` (compile_attn.hf registers it), so that an HF model accepts
#   it after ``import compile_attn`` without this import paying a second or more for transformers;
# - torch._dynamo: the backend name ``"compile_attn"``, for a source checkout that is not installed (an installed one
#   has the ``torch_dynamo_backends`` entry point, which Dynamo reads itself).
# Each runs now when its module is already imported, else right after that module's import finishes, through a finder
# that wraps the module's loader (it leaves sys.meta_path once every hook has run).
class _AfterImport(_importlib_abc.MetaPathFinder):
    def __init__(self, hooks: dict) -> None:
        self.hooks = hooks  # module name -> callable run after the module has loaded

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001, ANN201
        if fullname not in self.hooks:
            return None
        spec = next((s for f in _sys.meta_path if f is not self and hasattr(f, "find_spec")
                     and (s := f.find_spec(fullname, path, target)) is not None), None)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_hook(module):  # noqa: ANN001, ANN202
            exec_module(module)
            hook = self.hooks.pop(fullname, None)
            if not self.hooks and self in _sys.meta_path:
                _sys.meta_path.remove(self)
            if hook is not None:
                hook()

        spec.loader.exec_module = exec_then_hook
        return spec


def _run_hook(what: str, hook) -> None:  # noqa: ANN001
    """A failing hook is a warning: the import that triggered it goes on."""
    try:
        hook()
    except Exception as exc:  # noqa: BLE001
        import logging

        logging.getLogger(__name__).warning("compile_attn: %s failed: %s", what, exc)


def _register_hf() -> None:
    # a transformers older than 5 cannot import compile_attn.hf: a warning
    _run_hook("attn_implementation='compile_attn' (compile_attn.hf, needs transformers>=5)",
              lambda: _importlib.import_module("compile_attn.hf"))


def _compile_attn_backend(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
    """The backend ``"compile_attn"`` for Dynamo, loading the compiler on its first call (the hook below runs while
    Inductor may still be importing, so it cannot import the compiler itself)."""
    from compile_attn.compiler.backend import compile_attn_backend

    return compile_attn_backend(*args, **kwargs)


def _register_dynamo_backend() -> None:
    def register() -> None:
        from importlib.metadata import entry_points

        if not entry_points(group="torch_dynamo_backends", name="compile_attn"):  # not installed: no entry point
            from torch._dynamo.backends.registry import register_backend

            register_backend(_compile_attn_backend, name="compile_attn")

    _run_hook("registering the torch.compile backend 'compile_attn'", register)


def _install_hooks() -> None:
    hooks = {"transformers": _register_hf, "torch._dynamo": _register_dynamo_backend}
    for name in [n for n in hooks if n in _sys.modules]:
        hooks.pop(name)()
    if hooks and not any(isinstance(f, _AfterImport) for f in _sys.meta_path):
        _sys.meta_path.insert(0, _AfterImport(hooks))


_install_hooks()
