"""Host-time shortcuts of the compile backend, all behind ``config.host_shortcuts_enabled()``.

Each skips Python the plain path would run on every step; results are the same either way.

* ``install_piece``: a compiled piece goes into the split module's instance ``__dict__`` under its submodule's
  name, so the split graph's ``self.submod_i(...)`` finds it without ``nn.Module.__call__`` (the submodule stays
  in ``_modules``). Plain path: the piece is wrapped in an ``nn.Module`` that replaces the submodule.
* ``direct_split_piece``: a split-op piece (attention between two compiled pieces) calls its ops' Python bodies
  (given to ``register_split_op(..., python_impl=...)``) instead of ``torch.ops`` and the dispatcher. What no
  longer sees the op is a ``TorchDispatchMode`` around the compiled model; compile_attn's own (breakable capture)
  is only used for models that are not compiled. Plain path: the piece as traced.
* ``GraphEntry`` / ``record_graph_calls`` / ``DirectCall``: the backend hands Dynamo a ``GraphEntry``; while a
  record is open each call is noted with its arguments and outputs, and ``DirectCall.from_record`` turns the
  record of one model call into a call of the graph itself, without Dynamo's frame (its guards, its bytecode
  loading every parameter, Python side effects around the graph). That repeats the model call while the inputs
  are the same tensors (a graph runner's static buffers), nothing Dynamo guards on changed (the assumption
  ``GraphConfig.skip_guards`` makes), and the model's ``forward`` has no Python side effects outside its graph.
  Plain path: the backend returns the split module itself; the graph runner's use is in
  ``graph_runner/shortcuts.py``.

Tied to torch internals: the instance ``__dict__`` winning over ``nn.Module.__getattr__`` (tests pin it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from compile_attn.ops.split_registry import split_op_python_impl


# ---------------------------------------------------------------------------------------- pieces in the split module
class _Piece(torch.nn.Module):
    """The plain path's submodule: calls the compiled piece."""

    def __init__(self, runnable: Callable[..., Any]) -> None:
        super().__init__()
        self.runnable = runnable

    def forward(self, *args: Any) -> Any:
        return self.runnable(*args)


def install_piece(split_gm: fx.GraphModule, name: str, runnable: Callable[..., Any], shortcuts: bool) -> None:
    """Make the split module's call of submodule ``name`` run ``runnable``."""
    if shortcuts:
        split_gm.__dict__[name] = runnable  # shadows the submodule, which stays in _modules
    else:
        setattr(split_gm, name, _Piece(runnable))


def direct_split_piece(gm: fx.GraphModule) -> tuple[Callable[..., Any], int]:
    """(a callable running ``gm`` with its split ops' Python bodies called directly, how many calls were
    redirected). ``gm`` itself is left unchanged (the debug dump shows its graph as traced)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))  # node copies with shallow-copied meta (no fake-tensor deepcopy)
    redirected = 0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        impl = split_op_python_impl(node.target)
        if impl is not None:
            node.target = impl
            redirected += 1
    if not redirected:
        return gm.forward, 0
    direct = fx.GraphModule(gm, graph, class_name=f"{type(gm).__name__}Direct")
    return direct.forward, redirected


# ---------------------------------------------------------------------------------------- recorded graph calls
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
