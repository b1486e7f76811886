"""The one CUDA graph capture primitive used by every capture: piecewise (the compile backend's wrappers), full
and breakable (the graph runner).

It owns the process-wide graph memory pool, the gc policy during capture (collect once, then frozen, however
captures nest), weak references to graph outputs (so later captures can reuse pool memory), the warm-up call
before a capture, and the check that a replay's inputs sit at their capture-time addresses. It knows nothing of
models, buckets or modes: callers decide what to capture and when.

Every graph is owned by whoever was named by ``graph_owner`` when it was created (an engine names itself while it
builds), and ``release_graphs(owner)`` destroys an owner's graphs. A graph that captured an NCCL collective holds a
reference on its communicator until it is destroyed, and NCCL's abort waits for those references: a tensor-parallel
engine releases its graphs before it leaves its process group, or leaving it would never finish.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

_pool: object | None = None
_keepalive: torch.cuda.CUDAGraph | None = None
_gc_depth = 0
_owner: str | None = None  # set by ``graph_owner``: the owner of graphs created meanwhile
_live: weakref.WeakSet[CudaGraph] = weakref.WeakSet()


@contextlib.contextmanager
def graph_owner(name: str) -> Iterator[None]:
    """Graphs created inside this block belong to ``name`` (``release_graphs(name)`` destroys them)."""
    global _owner
    previous, _owner = _owner, name
    try:
        yield
    finally:
        _owner = previous


def release_graphs(owner: str | None = None) -> int:
    """Destroy every live graph of ``owner`` (of every owner when None) and return how many; they cannot be replayed
    afterwards. Call with no replay in flight (after a device synchronisation)."""
    released = 0
    for graph in list(_live):
        if owner is None or graph.owner == owner:
            graph.graph.reset()
            _live.discard(graph)
            released += 1
    return released


def graph_pool() -> object:
    """The process's graph pool, a handle from ``torch.cuda.graph_pool_handle()`` created on first use (CUDA only).

    The allocators free a graph pool when the last graph captured into it is destroyed; capturing into that stale
    handle again then fails an internal assertion (device and pinned-host allocators alike). A one-kernel graph
    captured into the pool and held for the life of the process keeps it alive, so runners and compiled models
    created one after another can all share it. Call outside a capture.
    """
    global _pool, _keepalive
    if _pool is None:
        pool = torch.cuda.graph_pool_handle()
        keepalive = torch.cuda.CUDAGraph()
        with torch.cuda.graph(keepalive, pool=pool):
            torch.zeros(1, device="cuda")
        _pool, _keepalive = pool, keepalive
    return _pool


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """Around captures: the outermost block collects garbage once and freezes every live object out of the
    collector's reach until it exits; nested blocks (a piecewise capture inside the runner's) change nothing."""
    global _gc_depth
    if _gc_depth == 0:
        gc.collect()
        gc.freeze()
    _gc_depth += 1
    try:
        yield
    finally:
        _gc_depth -= 1
        if _gc_depth == 0:
            gc.unfreeze()


def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor aliasing ``t``'s memory without keeping it alive (for graph pool memory: the graph owns it)."""
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(alias, t.storage_offset(), t.shape, t.stride())


def weak_ref_tree(tree: Any) -> Any:
    """``weak_ref_tensor`` on every CUDA tensor of a pytree (other leaves as they are)."""

    def conv(x: Any) -> Any:
        return weak_ref_tensor(x) if isinstance(x, torch.Tensor) and x.is_cuda else x

    return pytree.tree_map(conv, tree)


class CudaGraph:
    """One ``torch.cuda.CUDAGraph`` in the shared pool. Capture either as a block (``with g.capturing(stream):``,
    on a side stream, as ``torch.cuda.graph`` does) or between ``begin()`` and ``end()`` on the current stream (a
    breakable capture ends a segment in the middle of a forward)."""

    def __init__(self, pool: Any = None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool if pool is not None else graph_pool()
        self.owner = _owner
        _live.add(self)

    @contextlib.contextmanager
    def capturing(self, stream: Any = None) -> Iterator[None]:
        with torch.cuda.graph(self.graph, pool=self.pool, stream=stream):
            yield

    def begin(self) -> None:
        self.graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        with warnings.catch_warnings():  # a segment between two adjacent split ops may be empty; that is fine
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            self.graph.capture_end()

    def replay(self) -> None:
        self.graph.replay()


def capture_graph(
    fn: Callable[..., Any], args: tuple[Any, ...] = (), *, pool: Any = None, stream: Any = None,
    warm_up: bool = True, run: bool = True,
) -> tuple[CudaGraph, Any]:
    """Capture ``fn(*args)`` as one graph: ``warm_up`` calls it once first (lazy initialisation and autotuning
    stay out of the graph), the capture runs with gc frozen, ``run`` replays once after it (a capture only records:
    the replay makes the outputs hold this call's values). Returns the graph and its outputs; keep only
    ``weak_ref_tree(outputs)`` beyond the caller's use of them, so later captures can reuse their memory."""
    if warm_up:
        fn(*args)
    graph = CudaGraph(pool)
    with frozen_gc(), graph.capturing(stream):
        out = fn(*args)
    if run:
        graph.replay()
    return graph, out


def _addresses(args: tuple[Any, ...]) -> tuple[int | None, ...]:
    # A list comprehension, not a generator: this runs for every piece of every replayed step.
    return tuple([a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args])


def _shapes(args: tuple[Any, ...]) -> tuple[tuple[int, ...] | None, ...]:
    return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args)


@dataclass(frozen=True)
class InputAddresses:
    """Where a graph's inputs were at capture. A graph reads its inputs from those addresses, so a replay with an
    input elsewhere would read stale memory: ``moved`` finds such an input before the replay."""

    ptrs: tuple[int | None, ...]
    shapes: tuple[tuple[int, ...] | None, ...]
    checked: tuple[int, ...]  # inputs every replay checks: the tensors that are not parameters
    checked_ptrs: tuple[int, ...]

    @classmethod
    def of(cls, args: tuple[Any, ...]) -> InputAddresses:
        ptrs = _addresses(args)
        checked = tuple(i for i, a in enumerate(args)
                        if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter))
        return cls(ptrs, _shapes(args), checked, tuple([ptrs[i] for i in checked]))

    def moved(self, args: tuple[Any, ...], debug: bool) -> int | None:
        """The first input not at its capture-time address (``debug``: or of another shape), else None. Outside
        debug mode only the activations are checked: parameters stay where they are (in-place weight updates keep
        their addresses; replacing a parameter's tensor after capture needs the graphs captured again)."""
        if not debug and tuple([args[i].data_ptr() for i in self.checked]) == self.checked_ptrs:
            return None
        addresses = _addresses(args)
        if addresses != self.ptrs:
            return next(i for i, (a, b) in enumerate(zip(addresses, self.ptrs, strict=True)) if a != b)
        shapes = _shapes(args) if debug else self.shapes
        if shapes != self.shapes:
            return next(i for i, (a, b) in enumerate(zip(shapes, self.shapes, strict=True)) if a != b)
        return None
