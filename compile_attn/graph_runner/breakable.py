"""Breakable capture: one capture over a whole forward in which every split op ends the current graph
segment, runs eagerly, and a new segment begins.

A ``TorchDispatchMode`` active during capture sees each op. At a split op (``compile_attn.ops.is_split_op``,
attention by default) it ends the open CUDA graph capture, replays that segment once (so the eager
op computes on real values), runs the op and records the call with its capture-time arguments, then
begins the next segment in the same memory pool. Replay alternates segment replays and recorded
calls; the op body reads the live batch from the forward context, so capture-time arguments are
correct. On CPU the segments are op tapes (see ``segments``). Not for torch.compile'd models.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode

from compile_attn.compiler.cuda_graph import CudaGraph, frozen_gc, graph_pool, weak_ref_tree
from compile_attn.graph_runner.segments import CapturedGraph, GraphCaptureError, RecordedCall, Step, Tape
from compile_attn.ops import is_split_op
from compile_attn.ops.split_registry import split_op_python_impl

logger = logging.getLogger(__name__)

_HOST_SYNC = torch.ops.aten._local_scalar_dense.default


class SplitOpCapture(TorchDispatchMode):
    """Dispatch mode active during a capture: cuts segments at split ops, records ops on CPU tapes.

    ``breaks=False`` is the CPU emulation of a full graph: split ops are descended into, so the ops
    of their bodies (the attention backend's work) land on the tape like a CUDA graph would record them.
    """

    def __init__(self, device: torch.device, pool: Any, *, breaks: bool) -> None:
        super().__init__()
        self.cuda = device.type == "cuda"
        self.pool = graph_pool() if self.cuda and pool is None else pool  # resolved before the capture begins
        self.breaks = breaks
        self.steps: list[Step] = []
        self.num_segments = 0
        self.num_breaks = 0
        self._open: CudaGraph | Tape | None = None

    # ------------------------------------------------------------------ segments
    def begin_segment(self) -> None:
        if self.cuda:
            segment = CudaGraph(self.pool)
            segment.begin()
        else:
            segment = Tape()
        self._open = segment

    def end_segment(self) -> None:
        segment, self._open = self._open, None
        assert segment is not None, "end_segment without an open segment"
        if self.cuda:
            segment.end()
            segment.replay()  # capture does not execute: run the segment so what follows sees real values
        self.steps.append(segment)
        self.num_segments += 1

    def abort(self) -> None:
        """End an open CUDA capture after an error so the device is usable again."""
        if self._open is not None and self.cuda:
            with contextlib.suppress(Exception):
                self._open.end()
        self._open = None

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if is_split_op(func):
            if self.breaks:
                return self._eager_break(func, args, kwargs)
            if not self.cuda:
                return self._descend(func, args, kwargs)
        if func is _HOST_SYNC and self.cuda and args[0].is_cuda:
            raise GraphCaptureError(
                f"a captured segment read a CUDA tensor on the host (.item()/int()/.tolist()) in {func}; "
                f"graphs cannot. Make the op that needs it a split op (compile_attn.register_split_op)"
            )
        out = func(*args, **kwargs)
        if isinstance(self._open, Tape):
            self._open.record(func, args, kwargs, out)
        return out

    def _eager_break(self, func: Any, args: tuple, kwargs: dict) -> Any:
        self.end_segment()
        out = func(*args, **kwargs)
        self.steps.append(RecordedCall(func, args, kwargs, out))
        self.num_breaks += 1
        self.begin_segment()
        return out

    def _descend(self, func: Any, args: tuple, kwargs: dict) -> Any:
        impl = split_op_python_impl(func)
        opdef = OPDEFS.get(func._schema.name)
        if impl is None and opdef is not None:
            impl = opdef._init_fn
        if impl is None:  # no Python body known: record the call itself
            out = func(*args, **kwargs)
            assert isinstance(self._open, Tape)
            self._open.record(func, args, kwargs, out)
            return out
        with self:  # re-enter so the body's ops are recorded on the tape
            return impl(*args, **kwargs)


def capture_segments(
    fn: Callable[[], Any], *, device: torch.device, pool: Any = None, stream: Any = None, breaks: bool = True
) -> CapturedGraph:
    """Capture ``fn()`` as segments separated by eager split-op calls (``breaks``), or as one CPU tape."""
    mode = SplitOpCapture(device, pool, breaks=breaks)
    stream_ctx = torch.cuda.stream(stream) if mode.cuda and stream is not None else contextlib.nullcontext()
    if mode.cuda:  # the segments replay on the capture stream right away: pending work must be done
        torch.cuda.synchronize(device)
    with frozen_gc(), stream_ctx:
        mode.begin_segment()
        try:
            with mode:
                out = fn()
        except BaseException:
            mode.abort()
            raise
        mode.end_segment()
    if mode.cuda:
        torch.cuda.synchronize(device)
        # let later captures reuse the pool memory these tensors sit in
        for step in mode.steps:
            if isinstance(step, RecordedCall):
                step.args = weak_ref_tree(step.args)
                step.kwargs = weak_ref_tree(step.kwargs)
        out = weak_ref_tree(out)
    return CapturedGraph(mode.steps, out, num_segments=mode.num_segments, num_breaks=mode.num_breaks)
