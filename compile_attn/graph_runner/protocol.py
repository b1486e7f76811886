"""``RunnerLike``: what the runner's helpers (start-up warm-up, verify) use of a ``GraphRunner``, as a protocol.

``GraphRunner`` calls those helpers from ``capture``; they reach it through this protocol so that neither imports
the runner module (no import circle). Holds no code: ``Route`` and the members are the runner's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from compile_attn.graph_mode import GraphMode

if TYPE_CHECKING:
    import torch

    from compile_attn.attention.base import AttentionBackend
    from compile_attn.batch import ForwardBatch
    from compile_attn.graph_runner.plan import ModePlan
    from compile_attn.graph_runner.static_buffers import StaticBuffers
    from compile_attn.graph_runner.stats import GraphRunnerStats

Route = tuple[GraphMode, int]  # (graph mode, bucket): how a batch runs


class RunnerLike(Protocol):
    """The members of ``GraphRunner`` that ``warmup`` and ``verify`` read or call."""

    model: Any
    backend: AttentionBackend
    device: torch.device
    plan: ModePlan
    decode_buckets: tuple[int, ...]
    extend_buckets: tuple[int, ...]
    buffers: StaticBuffers
    stats: GraphRunnerStats
    fallback_logged: bool  # the eager-fallback line was logged once (later ones go to debug)

    def routes(self) -> list[tuple[GraphMode, str, int, int]]: ...
    def route(self, fb: ForwardBatch) -> Route | None: ...
    def shared_prefix_route(self, fb: ForwardBatch) -> Route | None: ...
    def run(self, fb: ForwardBatch) -> Any: ...
    def run_eager(self, fb: ForwardBatch) -> Any: ...
