"""Mode planning: what actually runs for decode and for extend batches, given the requested GraphMode,
the backend's declared graph support and whether the model is torch.compile'd.

Every downgrade from what the user asked for is logged once, in one line that says why. This module
decides; it captures nothing.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

from compile_attn.attention.base import GraphSupport
from compile_attn.graph_runner.mode import GraphMode

logger = logging.getLogger(__name__)


class ExecMode(str, enum.Enum):
    """How one step executes; the value is what the forward context's ``graph_mode`` says."""

    NONE = "none"  # eager
    FULL = "full"  # one CUDA graph with attention inside
    PIECEWISE = "piecewise"  # compiled model: the compile backend's wrappers capture the pieces
    BREAKABLE = "breakable"  # one capture, eager breaks at every split op (models that are not compiled)

    def uses_token_buckets(self) -> bool:
        """Piecewise and breakable graphs are keyed by token count (attention runs eagerly between pieces)."""
        return self in (ExecMode.PIECEWISE, ExecMode.BREAKABLE)


@dataclass(frozen=True)
class ModePlan:
    """What runs for decode batches and for extend/mixed batches."""

    decode: ExecMode
    extend: ExecMode


def is_compiled(model: Any) -> bool:
    """True for ``torch.compile(module)``, ``module.compile()`` and ``torch.compile(fn)`` results."""
    from torch._dynamo import eval_frame

    if isinstance(model, eval_frame.OptimizedModule):
        return True
    from compile_attn.compiler.compiled_model import CompiledModel

    if isinstance(model, CompiledModel):
        return True
    if getattr(model, "_compiled_call_impl", None) is not None:
        return True
    return hasattr(model, "_torchdynamo_orig_callable")


def _piecewise_kind(compiled: bool, reason: list[str]) -> ExecMode:
    if compiled:
        return ExecMode.PIECEWISE
    reason.append("the model is not torch.compile'd, so piecewise graphs run as one breakable capture")
    return ExecMode.BREAKABLE


def plan_modes(
    mode: GraphMode, graph_support: GraphSupport, *, compiled: bool, backend_name: str = ""
) -> ModePlan:
    """Resolve ``mode`` into a ModePlan; log one line per downgrade."""
    notes: list[str] = []
    if mode is GraphMode.NONE:
        return ModePlan(ExecMode.NONE, ExecMode.NONE)
    if graph_support is GraphSupport.NEVER:
        logger.info(
            "graph mode %s downgraded to none: attention backend %r declares graph_support NEVER",
            mode.value,
            backend_name,
        )
        return ModePlan(ExecMode.NONE, ExecMode.NONE)

    if mode is GraphMode.BREAKABLE:
        if compiled:
            notes.append(
                "breakable capture cannot trace a torch.compile'd model, so it runs piecewise "
                "(the compile backend's graphs; pass the uncompiled module for breakable graphs)"
            )
            decode = extend = ExecMode.PIECEWISE
        else:
            decode = extend = ExecMode.BREAKABLE
    else:
        if mode.decode_uses_full_graph():
            if graph_support.allows_full_decode():
                decode = ExecMode.FULL
            else:
                notes.append(
                    f"attention backend {backend_name!r} declares graph_support {graph_support.name}, "
                    f"so decode runs piecewise instead of in a full graph"
                )
                decode = _piecewise_kind(compiled, notes)
        else:  # PIECEWISE
            decode = _piecewise_kind(compiled, notes)
        extend = _piecewise_kind(compiled, notes) if mode.extend_uses_piecewise() else ExecMode.NONE

    for note in dict.fromkeys(notes):  # one line per distinct reason
        logger.info("graph mode %s: %s", mode.value, note)
    return ModePlan(decode, extend)
