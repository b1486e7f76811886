"""Inductor fusion heuristics that see the size of buffers over the unbacked token count.

The pieces are compiled with the token count unbacked (``CompiledModel``: one graph for every count). Inductor
scores a fusion by the bytes the two kernels share, and it sizes a buffer with an unbacked dimension as 0 bytes
(torch 2.11; 2.13 only when the size has a ``hint_override``). A reduction with no shared bytes is never fused,
so the residual add, the sum of squares and the scaling of an RMSNorm stay three kernels, and the two halves of a
rotary embedding two kernels each, where static or backed shapes give one (docs/performance.md).

``UnbackedFusionChoices`` is an ``InductorChoices`` (Inductor's hook for out-of-tree heuristics) that adds the
shared bytes Inductor counted as 0, each unbacked size taken as ``unbacked_symint_fallback`` (8192), before the
usual "no shared data" and horizontal-fusion threshold checks. Only buffers both kernels read or write at the
same index count, as in Inductor's own score; whether a fusion is legal is still decided by Inductor. The
order in which fusions are tried (``score_fusion``) is unchanged.

``FUSION_PATCHES`` names the class in the Inductor config, which puts it in Inductor's and compile_attn's cache
keys; ``choices_handler`` installs it for one compile (the config alone only takes effect in a thread whose
choices handler was not created yet).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from torch._inductor import config as inductor_config
from torch._inductor.choices import InductorChoices
from torch._inductor.virtualized import V

logger = logging.getLogger(__name__)


def unbacked_shared_bytes(node1: Any, node2: Any) -> int:
    """Bytes of the buffers that scheduler nodes ``node1`` and ``node2`` both access at the same index and whose
    size has an unbacked symbol (each such symbol taken as ``unbacked_symint_fallback``)."""
    deps2 = node2.read_writes.reads | node2.read_writes.writes
    total = 0
    for dep in node1.read_writes.reads | node1.read_writes.writes:
        if dep not in deps2 or not dep.has_unbacked_symbols():
            continue
        try:
            numel = V.graph.sizevars.optimization_hint(dep.get_numel(),
                                                       fallback=inductor_config.unbacked_symint_fallback)
            itemsize = V.graph.get_dtype(dep.name).itemsize
        except Exception:  # noqa: BLE001 - a dep without numel or dtype; a heuristic must not fail a compile
            logger.debug("compile_attn: no size for %s in a fusion score", dep, exc_info=True)
            continue
        total += int(numel) * itemsize
    return total


class UnbackedFusionChoices(InductorChoices):
    """Inductor's heuristics, with shared buffers of unbacked size counted in the fusion score."""

    def uuid(self) -> str:
        """Inductor's cache key for this heuristic (torch >= 2.13 asks a configured choices class for one)."""
        return "compile_attn.UnbackedFusionChoices.v1"

    @staticmethod
    def can_fuse(scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        score = shared_data_score + unbacked_shared_bytes(node1, node2)
        return InductorChoices.can_fuse(scheduler, node1, node2, score)

    @staticmethod
    def can_fuse_horizontal(scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        score = shared_data_score + unbacked_shared_bytes(node1, node2)
        return InductorChoices.can_fuse_horizontal(scheduler, node1, node2, score)


FUSION_PATCHES: dict[str, Any] = {"inductor_choices_class": UnbackedFusionChoices}


@contextlib.contextmanager
def choices_handler(patches: dict[str, Any]) -> Iterator[None]:
    """Inductor's choices handler for one compile: an instance of ``patches["inductor_choices_class"]``, if set."""
    cls = patches.get("inductor_choices_class")
    if cls is None:
        yield
        return
    with V.set_choices_handler(cls()):
        yield
