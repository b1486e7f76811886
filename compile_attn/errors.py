"""Exception types raised by compile_attn.

Every error names the bad value and the way out. The classes subclass the built-in exception a
caller would expect (ValueError for bad input, RuntimeError for bad state), so ``except ValueError``
keeps working for code that does not know about compile_attn.
"""

from __future__ import annotations


class CompileAttnError(Exception):
    """Base class of every error compile_attn raises on purpose."""


class InvalidBatchError(CompileAttnError, ValueError):
    """A ForwardBatch whose fields disagree with each other or with the KV cache."""


class InvalidConfigError(CompileAttnError, ValueError):
    """A constructor argument out of range or of the wrong kind: NaN, zero, negative, an unsupported dtype."""


class KVCacheExhaustedError(CompileAttnError, RuntimeError):
    """The KV pool or the request table has no room; nothing was allocated."""


class NoForwardContextError(CompileAttnError, RuntimeError):
    """The attention op ran outside ``forward_context(...)``."""


class UnknownBackendError(CompileAttnError, ValueError):
    """``create_backend`` was given a name no backend registered."""


class UnsupportedConfigError(CompileAttnError, ValueError):
    """A backend cannot run this layer or dtype configuration."""


class BackendUnavailableError(CompileAttnError, ImportError):
    """A backend's optional dependency is missing or the device cannot run it."""


class GraphReplayError(CompileAttnError, RuntimeError):
    """A captured graph was asked to replay with inputs it cannot read (moved or resized)."""


class KVCacheTooSmallError(CompileAttnError, ValueError):
    """The KV cache sized from memory cannot hold one request of ``max_context`` tokens."""


class ModelNotFoundError(CompileAttnError, FileNotFoundError):
    """A model (or tokenizer) name that is neither a local checkpoint directory nor a Hugging Face model id that is
    cached or can be downloaded (``compile_attn.hub``); the message says what was tried and the way out."""
