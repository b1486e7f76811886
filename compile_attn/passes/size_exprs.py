"""Decompose size expressions: no ``torch.Size`` and no derived symbolic scalar crosses a piece boundary.

A piece may pass tensors and the graph's own symbolic inputs (``s0``: the token count) to the next
one, but Inductor cannot return a ``torch.Size`` from a piece, and a SymInt computed in one piece
and used in another is fragile. So ``x.size()`` becomes per-dimension ``sym_size.int`` calls, and a
size expression used in another piece is re-bound to the graph input it equals, or recomputed there.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch import fx

_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)

# Pure functions of symbolic scalars (and tensor sizes): cheap to recompute in the piece that uses them.
_RECOMPUTABLE_FUNCTIONS: set[Any] = {
    operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod,
    operator.pow, operator.neg, operator.pos, operator.abs, operator.eq, operator.ne, operator.lt,
    operator.le, operator.gt, operator.ge, operator.and_, operator.or_, operator.not_,
    math.ceil, math.floor, math.sqrt, torch.sym_int, torch.sym_float, torch.sym_max, torch.sym_min,
    torch.sym_not, torch.sym_sqrt, torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_stride.int,
}
_RECOMPUTABLE_METHODS = {"size", "stride", "numel", "dim"}


def _is_sym(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("example_value"), _SYM_TYPES)


def _is_recomputable(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _RECOMPUTABLE_FUNCTIONS
    return node.op == "call_method" and node.target in _RECOMPUTABLE_METHODS and len(node.args) > 1


def _symbol_inputs(gm: fx.GraphModule) -> dict[Any, fx.Node]:
    """Symbolic graph inputs (``s0: Sym(s0)``) by their sympy symbol."""
    bound = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if isinstance(value, _SYM_TYPES) and getattr(value.node.expr, "is_Symbol", False):
            bound.setdefault(value.node.expr, node)
    return bound


def _dim_value(
    gm: fx.GraphModule, tensor: fx.Node, size: Any, dim: int, user: fx.Node,
    inputs: dict[Any, fx.Node], node_to_piece: dict[fx.Node, int],
) -> fx.Node | int:
    """``tensor.size(dim)`` (value ``size``) for ``user``: an int, a graph input or a node before ``user``."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    if size.node.expr in inputs:
        return inputs[size.node.expr]
    with gm.graph.inserting_before(user):
        node = gm.graph.call_function(torch.ops.aten.sym_size.int, (tensor, dim))
    node.meta["example_value"] = size
    node_to_piece[node] = node_to_piece[user]
    return node


def _decompose_full_sizes(gm: fx.GraphModule, node_to_piece: dict[fx.Node, int]) -> None:
    """Replace ``x.size()`` (a whole torch.Size) by ints, symbolic graph inputs or ``sym_size.int(x, d)``."""
    inputs = _symbol_inputs(gm)
    for size_node in list(gm.graph.find_nodes(op="call_method", target="size")):
        if len(size_node.args) != 1 or size_node.kwargs:
            continue  # x.size(d) is already a scalar
        tensor = size_node.args[0]
        shape = getattr(tensor.meta.get("example_value"), "shape", None)
        if shape is None:
            continue
        for user in list(size_node.users):
            is_getitem = user.op == "call_function" and user.target is operator.getitem
            if is_getitem and isinstance(user.args[1], int):
                d = user.args[1]
                user.replace_all_uses_with(_dim_value(gm, tensor, shape[d], d, user, inputs, node_to_piece))
                gm.graph.erase_node(user)
                node_to_piece.pop(user, None)
            else:
                whole = [_dim_value(gm, tensor, n, d, user, inputs, node_to_piece)
                         for d, n in enumerate(shape)]
                user.args = tuple(whole if a is size_node else a for a in user.args)
                user.kwargs = {k: (whole if a is size_node else a) for k, a in user.kwargs.items()}
        if not size_node.users:
            gm.graph.erase_node(size_node)
            node_to_piece.pop(size_node, None)


def _rebind_crossing_scalars(gm: fx.GraphModule, node_to_piece: dict[fx.Node, int]) -> None:
    """Give every piece its own copy of the symbolic scalars it uses from another piece."""
    inputs = _symbol_inputs(gm)
    copies: dict[tuple[fx.Node, int], fx.Node] = {}

    def local(node: fx.Node, piece: int, anchor: fx.Node) -> fx.Node:
        """``node``'s value available in ``piece``: the node, a graph input, or a copy before ``anchor``."""
        if node.op == "placeholder" or node_to_piece.get(node) == piece or not _is_sym(node):
            return node
        bound = inputs.get(node.meta["example_value"].node.expr)
        if bound is not None:
            return bound
        if not _is_recomputable(node):
            return node  # e.g. .item() of a tensor: passed across as is
        if (node, piece) not in copies:
            args = fx.node.map_arg(node.args, lambda a: local(a, piece, anchor))
            kwargs = fx.node.map_arg(node.kwargs, lambda a: local(a, piece, anchor))
            with gm.graph.inserting_before(anchor):
                copy = gm.graph.create_node(node.op, node.target, args, kwargs)  # type: ignore[arg-type]
            copy.meta = dict(node.meta)
            node_to_piece[copy] = piece
            copies[(node, piece)] = copy
        return copies[(node, piece)]

    for node in list(gm.graph.nodes):
        if node not in node_to_piece:
            continue
        piece = node_to_piece[node]
        for arg in list(node.all_input_nodes):
            if _is_sym(arg) and arg.op != "placeholder" and node_to_piece.get(arg) != piece:
                node.replace_input_with(arg, local(arg, piece, node))


def decompose_size_exprs(gm: fx.GraphModule, node_to_piece: dict[fx.Node, int]) -> None:
    """Rewrite ``gm`` in place so that only tensors and symbolic graph inputs cross pieces.

    ``node_to_piece`` maps every call node to its piece; nodes the pass creates are added to it and
    nodes it erases (including originals left without users) are removed from it.
    """
    _decompose_full_sizes(gm, node_to_piece)
    _rebind_crossing_scalars(gm, node_to_piece)
    for node in reversed(list(gm.graph.nodes)):  # originals whose every use now has a local copy
        if not node.users and _is_sym(node) and _is_recomputable(node):
            gm.graph.erase_node(node)
            node_to_piece.pop(node, None)
    gm.graph.lint()
    gm.recompile()
