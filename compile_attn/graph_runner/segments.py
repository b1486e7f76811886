"""Captured graphs as a list of replayable steps: CUDA graph segments (``compiler.cuda_graph.CudaGraph``), eager op
calls, and (on CPU) op tapes that stand in for CUDA graphs.

A ``CapturedGraph`` replays its steps in order and returns the capture-time output tensors, whose
contents the replay has just refreshed. On CUDA, tensors held after capture are weak references
into the shared graph pool, so later captures can reuse that memory (graphs replay one at a time).
On CPU a ``Tape`` records every op run during capture with its argument tensors and re-runs them at
replay, copying results into the recorded outputs: the same "fixed addresses, re-executed work"
semantics as a CUDA graph, so CPU tests catch stale metadata the way a GPU would.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from compile_attn.errors import CompileAttnError

logger = logging.getLogger(__name__)

aten = torch.ops.aten
# Factory ops whose contents are undefined: a replay need not recompute them (a CUDA graph does not either).
_UNINITIALIZED_FACTORIES = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_like.default,
        aten.empty_strided.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
    }
)


class GraphCaptureError(CompileAttnError, RuntimeError):
    """Work inside a captured region that a graph cannot replay (host sync, dynamic output shape)."""


class Step(Protocol):
    def replay(self) -> None: ...


# ---------------------------------------------------------------------------------------- op calls
def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def copy_into(recorded: Any, fresh: Any, what: str) -> None:
    """Copy the tensors of ``fresh`` into the matching ``recorded`` ones (skipping self-aliases)."""
    for rec, new in zip(pytree.tree_leaves(recorded), pytree.tree_leaves(fresh)):
        if not isinstance(rec, torch.Tensor):
            continue
        if rec.shape != new.shape:
            raise GraphCaptureError(
                f"{what} returned shape {tuple(new.shape)} at replay but {tuple(rec.shape)} at capture: "
                f"ops with data-dependent output shapes cannot run inside a captured graph; register the op "
                f"as a split op (compile_attn.register_split_op) so it runs eagerly between graph segments"
            )
        if not _same_view(rec, new):
            rec.copy_(new)


@dataclass
class RecordedCall:
    """One op call with its capture-time arguments; replay re-runs it and refreshes the recorded outputs."""

    func: Any
    args: tuple
    kwargs: dict
    out: Any

    def replay(self) -> None:
        fresh = self.func(*self.args, **self.kwargs)
        if self.out is not None:
            copy_into(self.out, fresh, str(self.func))


# ---------------------------------------------------------------------------------------- segments
@dataclass
class Tape:
    """CPU stand-in for a CUDA graph: the ops recorded during capture, re-run in order at replay."""

    calls: list[RecordedCall] = field(default_factory=list)

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if func is aten._local_scalar_dense.default:
            raise GraphCaptureError(
                "a captured region read a tensor value on the host (.item(), int(t), bool(t), .tolist()); a "
                "CUDA graph would bake in the capture-time value. Move that work to "
                "init_forward_metadata_out_graph, or make the op a split op"
            )
        self.calls.append(RecordedCall(func, args, kwargs, out))

    def replay(self) -> None:
        for call in self.calls:
            if call.func not in _UNINITIALIZED_FACTORIES:
                call.replay()


@dataclass
class CapturedGraph:
    """Steps (graph segments and eager calls) replayed in order; ``output`` holds the forward's result."""

    steps: list[Step]
    output: Any
    num_segments: int = 1
    num_breaks: int = 0

    def replay(self) -> Any:
        for step in self.steps:
            step.replay()
        return self.output


@dataclass
class RerunGraph:
    """Replay by calling the function again (CPU only: torch.compile'd models a Tape cannot trace)."""

    fn: Any
    num_segments: int = 1
    num_breaks: int = 0

    def replay(self) -> Any:
        return self.fn()
