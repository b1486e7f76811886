"""Captured graphs as a list of replayable steps: CUDA graph segments, eager op calls, and (on CPU)
op tapes that stand in for CUDA graphs.

A ``CapturedGraph`` replays its steps in order and returns the capture-time output tensors, whose
contents the replay has just refreshed. On CUDA, tensors held after capture are weak references
into the shared graph pool, so later captures can reuse that memory (graphs replay one at a time).
On CPU a ``Tape`` records every op run during capture with its argument tensors and re-runs them at
replay, copying results into the recorded outputs: the same "fixed addresses, re-executed work"
semantics as a CUDA graph, so CPU tests catch stale metadata the way a GPU would.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import warnings
from collections.abc import Iterator
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


# ---------------------------------------------------------------------------------------- weak refs
def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor aliasing ``t``'s memory without keeping it alive (CUDA graph pool memory only)."""
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(alias, t.storage_offset(), t.shape, t.stride())


def weak_ref_tree(tree: Any, keep: set[int] | None = None) -> Any:
    """``weak_ref_tensor`` on every CUDA tensor of a pytree, except storages listed in ``keep``."""
    keep = keep or set()

    def conv(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_cuda and x.untyped_storage().data_ptr() not in keep:
            return weak_ref_tensor(x)
        return x

    return pytree.tree_map(conv, tree)


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


class CudaSegment:
    """One ``torch.cuda.CUDAGraph`` captured into the shared pool."""

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def begin(self) -> None:
        self.graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        with warnings.catch_warnings():  # a segment between two adjacent split ops may be empty; that is fine
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            self.graph.capture_end()

    def replay(self) -> None:
        self.graph.replay()


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


# ---------------------------------------------------------------------------------------- session
@contextlib.contextmanager
def capture_session(device: torch.device) -> Iterator[None]:
    """Around a series of captures: collect garbage once, then freeze gc so captures do not pay for it."""
    gc.collect()
    gc.freeze()
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        yield
    finally:
        gc.unfreeze()
