"""The forward context: which batch, backend, layers and KV cache the current step uses.

The attention op reads per-step state from here, never from its arguments, because a captured
graph (or a breakable graph's eager break) replays the op with its capture-time arguments. The
context is process-global (one step runs at a time) and set with ``forward_context(...)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from compile_attn.errors import NoForwardContextError

if TYPE_CHECKING:
    from compile_attn.attention.base import AttentionBackend
    from compile_attn.batch import ForwardBatch
    from compile_attn.kv_cache import KVCache
    from compile_attn.layer import AttentionLayer


@dataclass
class ForwardContext:
    """State of the step being run.

    ``graph_mode`` is set by the graph runner to the mode executing this step ("none", "piecewise",
    "full", "breakable"); piecewise wrappers inside a compiled model capture/replay only when it is
    "piecewise" or unset (None: no runner, components use their own defaults), and pass through
    otherwise (e.g. inside a full-graph capture).
    """

    batch: ForwardBatch
    backend: AttentionBackend
    layers: Mapping[int, AttentionLayer]
    kv_cache: KVCache
    graph_mode: str | None = None
    extra: dict = field(default_factory=dict)

    def layer(self, layer_id: int) -> AttentionLayer:
        try:
            return self.layers[layer_id]
        except KeyError:
            raise KeyError(
                f"layer_id {layer_id} has no AttentionLayer in the forward context (known: {sorted(self.layers)})"
            ) from None


_current: ForwardContext | None = None


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
    graph_mode: str | None = None,
) -> Iterator[ForwardContext]:
    """Make ``batch`` the current step for the duration of the ``with`` block.

    ``layers`` and ``kv_cache`` default to the backend's own. Contexts nest; the previous one is
    restored on exit.
    """
    global _current
    ctx = ForwardContext(
        batch=batch,
        backend=backend,
        layers=_as_mapping(layers if layers is not None else backend.layers),
        kv_cache=kv_cache if kv_cache is not None else backend.kv_cache,
        graph_mode=graph_mode,
    )
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    """The current step's context; NoForwardContextError outside ``forward_context(...)``."""
    if _current is None:
        raise NoForwardContextError(
            "torch.ops.compile_attn.attention ran with no forward context. Run the model inside "
            "`with compile_attn.forward_context(batch, backend): ...` (the engine and GraphRunner do "
            "this for you), or use the model outside compile_attn with its stock attention"
        )
    return _current


def has_forward_context() -> bool:
    return _current is not None
