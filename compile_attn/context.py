"""The forward context: which batch, backend, layers and KV cache the current step uses.

The attention op reads per-step state from here, never from its arguments, because a captured
graph (or a breakable graph's eager break) replays the op with its capture-time arguments. The
context is set with ``forward_context(...)`` and belongs to the thread (or asyncio task) that set it: a
``ContextVar``, so two engines in two threads each see their own step, and nested blocks restore the
enclosing one on exit.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from compile_attn.errors import NoForwardContextError
from compile_attn.graph_mode import GraphMode

if TYPE_CHECKING:
    from compile_attn.attention.base import AttentionBackend
    from compile_attn.batch import ForwardBatch
    from compile_attn.kv.cache import KVCache
    from compile_attn.layer import AttentionLayer


@dataclass
class ForwardContext:
    """State of the step being run.

    ``graph_mode`` is set by the graph runner to the mode executing this step (``GraphMode.NONE``, ``PIECEWISE``,
    ``FULL`` or ``BREAKABLE``; None: no runner) and ``bucket`` to the token count of the graph it captures or
    replays (None: an eager step). The compile backend's piecewise wrappers capture and replay only when the mode
    is ``PIECEWISE``, keyed by ``bucket``, and pass through otherwise (e.g. inside a full-graph capture).
    """

    batch: ForwardBatch
    backend: AttentionBackend
    layers: Mapping[int, AttentionLayer]
    kv_cache: KVCache
    graph_mode: GraphMode | None = None
    bucket: int | None = None

    def layer(self, layer_id: int) -> AttentionLayer:
        try:
            return self.layers[layer_id]
        except KeyError:
            raise KeyError(
                f"layer_id {layer_id} has no AttentionLayer in the forward context (known: {sorted(self.layers)})"
            ) from None


_current: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "compile_attn_forward_context", default=None
)
# Dynamo cannot trace ContextVar.get, but it traces (and guards on) a thread-local's attribute: code being compiled
# reads this per-thread copy of "is there a context", kept equal to the ContextVar by forward_context.
_traced = threading.local()


def _as_mapping(layers: Sequence[AttentionLayer] | Mapping[int, AttentionLayer]) -> Mapping[int, AttentionLayer]:
    if isinstance(layers, Mapping):
        return layers
    return {layer.layer_id: layer for layer in layers}


@contextlib.contextmanager
def forward_context(
    batch: ForwardBatch,
    backend: AttentionBackend,
    layers: Sequence[AttentionLayer] | Mapping[int, AttentionLayer] | None = None,
    kv_cache: KVCache | None = None,
    graph_mode: GraphMode | str | None = None,
    bucket: int | None = None,
) -> Iterator[ForwardContext]:
    """Make ``batch`` the current step for the duration of the ``with`` block.

    ``layers`` and ``kv_cache`` default to the backend's own; ``graph_mode`` may be given by its value ("full").
    Contexts nest; the previous one is restored on exit.
    """
    ctx = ForwardContext(
        batch=batch,
        backend=backend,
        layers=_as_mapping(layers if layers is not None else backend.layers),
        kv_cache=kv_cache if kv_cache is not None else backend.kv_cache,
        graph_mode=None if graph_mode is None else GraphMode.parse(graph_mode),
        bucket=bucket,
    )
    token = _current.set(ctx)
    _traced.active = True
    try:
        yield ctx
    finally:
        _current.reset(token)
        _traced.active = _current.get() is not None


def get_forward_context() -> ForwardContext:
    """The current step's context; NoForwardContextError outside ``forward_context(...)``."""
    ctx = _current.get()
    if ctx is None:
        raise NoForwardContextError(
            "torch.ops.compile_attn.attention ran with no forward context. Run the model inside "
            "`with compile_attn.forward_context(batch, backend): ...` (the engine and GraphRunner do "
            "this for you), or use the model outside compile_attn with its stock attention"
        )
    return ctx


def current_forward_context() -> ForwardContext | None:
    """The current step's context or None; for code that runs outside Dynamo's tracing (a compiled piece's
    wrapper), once per call, so without ``has_forward_context``'s check for tracing."""
    return _current.get()


def has_forward_context() -> bool:
    """Whether this thread (or task) is inside ``forward_context(...)``."""
    if torch.compiler.is_compiling():  # under Dynamo: the thread-local copy it can trace and guard on
        return getattr(_traced, "active", False)
    return _current.get() is not None
