"""Specialize the Python floats Dynamo turned into tensor inputs (``rope_theta``, ``eps``, ...).

Dynamo passes a float attribute as a 0-d tensor input read back with ``.item()``. Inductor folds that
back for a whole graph, but not for a piece cut out of it, so before splitting every such ``.item()``
becomes the float's value, with a guard on it: a changed value recompiles, never runs stale code.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

logger = logging.getLogger(__name__)


def _tensorified_float_symbol(node: fx.Node) -> str | None:
    """Name of the float symbol behind a placeholder Dynamo made from a Python float, else None."""
    if node.op != "placeholder":
        return None
    value = node.meta.get("example_value")
    memo = getattr(value, "item_memo", None)
    if memo is None or not isinstance(memo, torch.SymFloat):
        return None
    expr = getattr(memo.node, "_expr", None)
    name = getattr(expr, "name", None)
    if name is None or not node.users or any(u.target != "item" for u in node.users):
        return None  # Dynamo only folds placeholders read solely through .item()
    return name


def specialize_tensorified_floats(gm: fx.GraphModule) -> list[str]:
    """Replace every ``.item()`` of a tensorified Python float in ``gm`` by the float's value, guarded.

    ``guard_scalar`` records a guard on the float's source (e.g. ``cfg.rope_theta == 10000.0``), so a
    changed value recompiles instead of reusing stale code; the symbol is marked specialized so that
    Inductor does not ask Dynamo to restart the trace for it. Returns the specialized placeholders'
    names. Where that is not possible, Dynamo is asked to re-trace with the floats specialized.
    """
    try:
        from torch._dynamo.exc import TensorifyScalarRestartAnalysis
        from torch._dynamo.symbolic_convert import TensorifyState
        from torch.fx.experimental.symbolic_shapes import guard_scalar
    except ImportError:  # pragma: no cover - older torch without tensorified floats
        return []
    done, restart = [], []
    for node in list(gm.graph.find_nodes(op="placeholder")):
        name = _tensorified_float_symbol(node)
        if name is None or TensorifyState.should_specialize(name):
            continue
        TensorifyState.specialize(name)
        try:
            value = float(guard_scalar(node.meta["example_value"].item_memo))
        except Exception:  # noqa: BLE001 - fall back to Dynamo's own re-trace
            restart.append(f"{node.name} ({name})")
            continue
        for user in list(node.users):
            user.replace_all_uses_with(value)  # type: ignore[arg-type]
            gm.graph.erase_node(user)
        done.append(node.name)
    if restart:
        logger.info("compile_attn: re-tracing to specialize Python float input(s) %s", ", ".join(restart))
        raise TensorifyScalarRestartAnalysis
    if done:
        gm.recompile()
        logger.debug("compile_attn: specialized Python float input(s) %s", ", ".join(done))
    return done
