"""Eager split-op pieces that call their ops' Python bodies directly.

A split-op piece (attention between two compiled pieces) runs once per layer per step, on the host's critical
path in piecewise decode. Called as a submodule through ``torch.ops``, each call pays ``nn.Module.__call__``
and the dispatcher's argument parsing and Python re-entry before the body runs. For ops registered with a
Python body (``register_split_op(op, python_impl=...)``, as the attention op is), the piece's copy made here
calls that body itself, and the compiled model calls the copy's ``forward``. Ops without a known body keep
their ``torch.ops`` call.

Behaviour is the same: the body is what the op's only kernel (CompositeExplicitAutograd) runs. What no longer
sees the op is a ``TorchDispatchMode`` around the compiled model; compile_attn's own (the breakable runner's)
is only used for models that are not compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import fx

from compile_attn.ops.split_registry import split_op_python_impl


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
