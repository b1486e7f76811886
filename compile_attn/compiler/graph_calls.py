"""Calls of a compiled graph, recorded so that a graph runner can repeat one without Dynamo's frame.

Dynamo runs a compiled model through its frame on every call: it evaluates the guards (or, under
``skip_guard_eval_unsafe``, skips them), runs the bytecode it generated (loading each parameter as a graph
input, then any Python side effects around the graph) and calls the graph the backend compiled: host time
spent before the first piece runs, on every piecewise step (docs/performance.md).

The compile backend hands Dynamo a :class:`GraphEntry`. While :func:`record_graph_calls` is open, each call of
an entry is noted with its arguments and outputs. :meth:`DirectCall.from_record` turns the record of one
model call into a :class:`DirectCall` when that call ran exactly one graph and returned one of its output
tensors; calling it runs the same graph with the same arguments and returns that output, which is what the
model call would do again as long as

- the inputs are the same tensors (a graph runner passes its static buffers: same addresses every step) and
  nothing Dynamo guards on has changed (the assumption ``GraphConfig.skip_guards`` already makes), and
- the model's ``forward`` has no Python side effects outside its graph (Dynamo would replay them; a direct
  call does not), which holds for compile_attn's models and HF transformers' decoders.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class GraphCall:
    """One call of a compiled graph: what ran (``fn``), with which arguments, and what it returned."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    outputs: Any


_RECORDS: list[list[GraphCall]] = []  # open records, innermost last


class GraphEntry:
    """The callable the compile backend returns to Dynamo for one graph: runs ``module`` (the split GraphModule)
    and notes the call in the innermost open record."""

    __slots__ = ("module",)

    def __init__(self, module: torch.fx.GraphModule) -> None:
        self.module = module

    def __call__(self, *args: Any) -> Any:
        outputs = self.module(*args)
        if _RECORDS:
            # What a direct call runs: the generated ``forward`` itself, no ``nn.Module.__call__`` around it. Read
            # after the call: a lazily recompiled GraphModule installs its real ``forward`` on its first call.
            _RECORDS[-1].append(GraphCall(self.module.forward, args, outputs))
        return outputs


@contextlib.contextmanager
def record_graph_calls() -> Iterator[list[GraphCall]]:
    """Within the block, every call of a compile_attn graph is appended to the yielded list."""
    record: list[GraphCall] = []
    _RECORDS.append(record)
    try:
        yield record
    finally:
        _RECORDS.remove(record)


@dataclass(frozen=True)
class DirectCall:
    """A recorded graph call repeated as it was: ``direct()`` returns ``outputs[index]`` of a new call.

    Holds the call's arguments (the runner's static input views, the model's parameters, ints), none of its
    outputs."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    index: int

    @classmethod
    def from_record(cls, calls: Sequence[GraphCall], result: Any) -> DirectCall | None:
        """The direct form of a model call that made ``calls`` and returned ``result``; None unless it ran one
        graph, once, and returned one of that graph's output tensors as it was."""
        if len(calls) != 1 or not isinstance(result, torch.Tensor):
            return None
        call = calls[0]
        outputs = call.outputs if isinstance(call.outputs, (tuple, list)) else (call.outputs,)
        index = next((i for i, o in enumerate(outputs) if o is result), None)
        if index is None:
            return None
        return cls(call.fn, call.args, index)

    def __call__(self) -> torch.Tensor:
        outputs = self.fn(*self.args)
        return outputs[self.index] if isinstance(outputs, (tuple, list)) else outputs
