"""Mode planning: what actually runs for decode and for extend batches, given the requested GraphMode, what the
attention backend supports (a GraphMode too) and whether the model is torch.compile'd.

Every downgrade from what the user asked for is logged once, in one line that says why. This module
decides; it captures nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from compile_attn.compiler.compiled_model import CompiledModel
from compile_attn.graph_mode import GraphMode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModePlan:
    """What runs for decode batches and for extend/mixed batches: NONE, FULL, PIECEWISE or BREAKABLE each."""

    decode: GraphMode
    extend: GraphMode


def is_compiled(model: Any) -> bool:
    """True for ``torch.compile(module)``, ``module.compile()`` and ``torch.compile(fn)`` results."""
    from torch._dynamo import eval_frame

    if isinstance(model, (eval_frame.OptimizedModule, CompiledModel)):
        return True
    if getattr(model, "_compiled_call_impl", None) is not None:
        return True
    return hasattr(model, "_torchdynamo_orig_callable")


def _piecewise_kind(compiled: bool, reason: list[str]) -> GraphMode:
    if compiled:
        return GraphMode.PIECEWISE
    reason.append("the model is not torch.compile'd, so piecewise graphs run as one breakable capture")
    return GraphMode.BREAKABLE


def plan_modes(mode: GraphMode, graph_support: GraphMode, *, compiled: bool, backend_name: str = "") -> ModePlan:
    """Resolve ``mode`` into a ModePlan for a backend that supports ``graph_support``; log one line per downgrade."""
    notes: list[str] = []
    if mode is GraphMode.NONE:
        return ModePlan(GraphMode.NONE, GraphMode.NONE)
    if graph_support is GraphMode.NONE:
        logger.info("graph mode %s downgraded to none: attention backend %r declares graph_support none",
                    mode.value, backend_name)
        return ModePlan(GraphMode.NONE, GraphMode.NONE)

    if mode is GraphMode.BREAKABLE:
        if compiled:
            notes.append(
                "breakable capture cannot trace a torch.compile'd model, so it runs piecewise "
                "(the compile backend's graphs; pass the uncompiled module for breakable graphs)"
            )
            decode = extend = GraphMode.PIECEWISE
        else:
            decode = extend = GraphMode.BREAKABLE
    else:
        decode = mode.decode_mode()
        if decode is GraphMode.FULL and graph_support.decode_mode() is not GraphMode.FULL:
            notes.append(
                f"attention backend {backend_name!r} declares graph_support {graph_support.value}, "
                f"so decode runs piecewise instead of in a full graph"
            )
            decode = GraphMode.PIECEWISE
        if decode is GraphMode.PIECEWISE:
            decode = _piecewise_kind(compiled, notes)
        extend = _piecewise_kind(compiled, notes) if mode.extend_mode() is GraphMode.PIECEWISE else GraphMode.NONE

    for note in dict.fromkeys(notes):  # one line per distinct reason
        logger.info("graph mode %s: %s", mode.value, note)
    return ModePlan(decode, extend)
