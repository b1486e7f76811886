"""PiecewiseGraphWrapper: runs one compiled piece as a CUDA graph captured per token-count bucket.

The first call at a bucket size runs the piece once (warm-up), captures it into the shared graph
pool with gc frozen, replays it once and keeps weak references to its outputs; later calls of that
size replay. Other sizes run the piece without a graph. Padding to buckets is the GraphRunner's
job: a replay whose inputs are not at their capture-time addresses is refused (an error in debug
mode, else the piece runs without its graph). Inside a runner's full-graph capture it passes through.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from compile_attn.compiler.counters import compile_counters
from compile_attn.context import get_forward_context, has_forward_context
from compile_attn.errors import GraphReplayError  # noqa: F401  (re-exported: raised by the wrapper)
from compile_attn.graph_runner.segments import weak_ref_tensor

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Move every live object out of the collector's reach for the duration (captures stay fast)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class CudaGraphOps:
    """Capture and replay with real CUDA graphs in the process-wide graph pool."""

    def capture(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, Any]:
        from compile_attn.graph_runner.memory_pool import get_graph_pool

        graph = torch.cuda.CUDAGraph()
        with gc_frozen(), torch.cuda.graph(graph, pool=get_graph_pool()):
            out = fn(*args)
        return graph, out

    def replay(self, graph: Any) -> None:
        graph.replay()

    def weak_refs(self, outputs: Any) -> Any:
        return tree_map(lambda x: weak_ref_tensor(x) if isinstance(x, torch.Tensor) else x, outputs)


@dataclass
class _Captured:
    graph: Any
    outputs: Any  # weak references into the graph pool
    input_ptrs: tuple[int | None, ...]
    input_shapes: tuple[tuple[int, ...] | None, ...]
    checked: tuple[int, ...]  # inputs whose address every replay checks: the tensors that are not parameters
    checked_ptrs: tuple[int, ...]


def _addresses(args: tuple[Any, ...]) -> tuple[int | None, ...]:
    # A list comprehension, not a generator: this runs for every piece of every replayed step.
    return tuple([a.data_ptr() if isinstance(a, torch.Tensor) else None for a in args])


def _activations(args: tuple[Any, ...]) -> tuple[int, ...]:
    """Positions of the tensor inputs that are not ``nn.Parameter``s (a piece's weights are most of its inputs)."""
    return tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter))


def _shapes(args: tuple[Any, ...]) -> tuple[tuple[int, ...] | None, ...]:
    return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args)


class PiecewiseGraphWrapper:
    """Callable standing in for one compiled piece inside the split graph.

    ``token_count(args)`` reads the piece's token count from its inputs; ``capture_sizes`` are the
    buckets captured. ``debug`` turns refused replays into errors. ``on_capture(size)`` is told
    about each capture (debug summary). ``ops`` does the capture and replay (CUDA graphs; tests
    substitute a stand-in).
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        name: str,
        capture_sizes: Collection[int],
        token_count: Callable[[tuple[Any, ...]], int],
        *,
        debug: bool = False,
        on_capture: Callable[[str, int], None] | None = None,
        ops: Any = None,
    ) -> None:
        self.runnable = runnable
        self.name = name
        self.capture_sizes = frozenset(capture_sizes)
        self.token_count = token_count
        self.debug = debug
        self.on_capture = on_capture
        self.ops = ops if ops is not None else CudaGraphOps()
        self.captured: dict[int, _Captured] = {}
        self._warned_refusal = False
        self._cuda = torch.cuda.is_available()  # asked once: this wrapper runs once per piece per step

    def _passes_through(self) -> bool:
        """True inside another capture (the runner's full graph) or when the runner runs another mode."""
        if has_forward_context() and get_forward_context().graph_mode not in (None, "piecewise"):
            return True
        return self._cuda and torch.cuda.is_current_stream_capturing()

    def __call__(self, *args: Any) -> Any:
        if not self.capture_sizes or self._passes_through():
            return self.runnable(*args)
        size = self.token_count(args)
        if size not in self.capture_sizes:
            return self.runnable(*args)
        entry = self.captured.get(size)
        if entry is None:
            return self._capture(size, args)
        moved = self._moved_input(entry, args)
        if moved is not None:
            self._refuse(size, moved, entry, args)
            return self.runnable(*args)
        self.ops.replay(entry.graph)
        compile_counters.graph_replays += 1
        return entry.outputs

    def _capture(self, size: int, args: tuple[Any, ...]) -> Any:
        self.runnable(*args)  # warm-up: lazy initialisation and autotuning happen outside the capture
        graph, out = self.ops.capture(self.runnable, args)
        self.ops.replay(graph)  # a capture only records; run it so that `out` holds this call's values
        ptrs, checked = _addresses(args), _activations(args)
        self.captured[size] = _Captured(graph, self.ops.weak_refs(out), ptrs, _shapes(args), checked,
                                        tuple([ptrs[i] for i in checked]))
        compile_counters.graphs_captured += 1
        if self.on_capture is not None:
            self.on_capture(self.name, size)
        logger.debug("compile_attn: captured %s at %d tokens", self.name, size)
        return out

    def _moved_input(self, entry: _Captured, args: tuple[Any, ...]) -> int | None:
        """The first input not at its capture-time address (or, in debug mode, shape), else None. Outside debug
        mode only the activations are checked: parameters stay where they are (in-place weight updates keep their
        addresses; replacing a parameter's tensor after capture needs the graphs captured again)."""
        if not self.debug:
            if tuple([args[i].data_ptr() for i in entry.checked]) == entry.checked_ptrs:
                return None
        addresses = _addresses(args)
        if addresses != entry.input_ptrs:
            return next(i for i, (a, b) in enumerate(zip(addresses, entry.input_ptrs, strict=True)) if a != b)
        shapes = _shapes(args) if self.debug else entry.input_shapes
        if shapes != entry.input_shapes:
            return next(i for i, (a, b) in enumerate(zip(shapes, entry.input_shapes, strict=True)) if a != b)
        return None

    def _refuse(self, size: int, index: int, entry: _Captured, args: tuple[Any, ...]) -> None:
        compile_counters.replays_refused += 1
        arg = args[index]
        message = (
            f"piecewise CUDA graph of {self.name} at {size} tokens was captured with input {index} "
            f"(shape {entry.input_shapes[index]}) at address {entry.input_ptrs[index]:#x}, but this call "
            f"passes "
            f"shape {tuple(arg.shape)} at {arg.data_ptr():#x}; a graph reads its inputs from the captured "
            f"addresses. Feed the model from static input buffers sliced to the bucket size (GraphRunner "
            f"does this), or leave this size out of the capture sizes"
        )
        if self.debug:
            raise GraphReplayError(message)
        if not self._warned_refusal:
            logger.warning("compile_attn: %s; running without the graph (warned once per piece)", message)
            self._warned_refusal = True
