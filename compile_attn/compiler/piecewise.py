"""PiecewiseGraphWrapper: runs one compiled piece as a CUDA graph per bucket of the graph runner's piecewise steps.

The wrapper reads the step from the forward context: when the graph runner runs a ``GraphMode.PIECEWISE`` step,
``ctx.bucket`` is the token count its static buffers were padded to. The first such call at a bucket captures the
piece (``cuda_graph.capture_graph``: warm-up, capture, one replay) and keeps weak references to its outputs; later
calls replay. Every other call (no runner, another mode such as the runner's full-graph capture, an eager step) runs
the piece as it is. Buckets are the runner's alone: the compile backend passes no sizes. A replay whose inputs
are not at their capture-time addresses is refused (an error in debug mode, else the piece runs without its graph).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from compile_attn.compiler.counters import compile_counters
from compile_attn.compiler.cuda_graph import InputAddresses, capture_graph, weak_ref_tree
from compile_attn.context import current_forward_context
from compile_attn.errors import GraphReplayError
from compile_attn.graph_mode import GraphMode

logger = logging.getLogger(__name__)

_PIECEWISE = GraphMode.PIECEWISE


@dataclass
class _Captured:
    graph: Any  # has replay()
    outputs: Any  # weak references into the graph pool
    inputs: InputAddresses


class PiecewiseGraphWrapper:
    """Callable standing in for one compiled piece inside the split graph.

    ``token_count(args)`` reads the piece's token count from its inputs (a piece is captured only when it equals
    the step's bucket). ``debug`` turns refused replays into errors. ``on_capture(name, size)`` is told about each
    capture (debug summary). ``capture(fn, args) -> (graph, outputs)`` captures (default
    ``cuda_graph.capture_graph``; tests substitute a stand-in for CPU).
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        name: str,
        token_count: Callable[[tuple[Any, ...]], int],
        *,
        debug: bool = False,
        on_capture: Callable[[str, int], None] | None = None,
        capture: Callable[[Callable[..., Any], tuple[Any, ...]], tuple[Any, Any]] = capture_graph,
    ) -> None:
        self.runnable = runnable
        self.name = name
        self.token_count = token_count
        self.debug = debug
        self.on_capture = on_capture
        self.capture = capture
        self.captured: dict[int, _Captured] = {}
        self._warned_refusal = False

    def __call__(self, *args: Any) -> Any:
        ctx = current_forward_context()
        if ctx is None or ctx.graph_mode is not _PIECEWISE or ctx.bucket is None:
            return self.runnable(*args)
        size = ctx.bucket
        if self.token_count(args) != size:  # not padded to the bucket: nothing to replay it with
            return self.runnable(*args)
        entry = self.captured.get(size)
        if entry is None:
            return self._capture(size, args)
        moved = entry.inputs.moved(args, self.debug)
        if moved is not None:
            self._refuse(size, moved, entry, args)
            return self.runnable(*args)
        entry.graph.replay()
        compile_counters.graph_replays += 1
        return entry.outputs

    def _capture(self, size: int, args: tuple[Any, ...]) -> Any:
        graph, outputs = self.capture(self.runnable, args)
        self.captured[size] = _Captured(graph, weak_ref_tree(outputs), InputAddresses.of(args))
        compile_counters.graphs_captured += 1
        if self.on_capture is not None:
            self.on_capture(self.name, size)
        logger.debug("compile_attn: captured %s at %d tokens", self.name, size)
        return outputs

    def _refuse(self, size: int, index: int, entry: _Captured, args: tuple[Any, ...]) -> None:
        compile_counters.replays_refused += 1
        arg = args[index]
        message = (
            f"piecewise CUDA graph of {self.name} at {size} tokens was captured with input {index} "
            f"(shape {entry.inputs.shapes[index]}) at address {entry.inputs.ptrs[index]:#x}, but this call "
            f"passes shape {tuple(arg.shape)} at {arg.data_ptr():#x}; a graph reads its inputs from the captured "
            f"addresses. Feed the model from static input buffers sliced to the bucket size (GraphRunner "
            f"does this)"
        )
        if self.debug:
            raise GraphReplayError(message)
        if not self._warned_refusal:
            logger.warning("compile_attn: %s; running without the graph (warned once per piece)", message)
            self._warned_refusal = True
