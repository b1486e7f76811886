"""The token count: the one dynamic dimension, found in a Dynamo graph and read from a piece's inputs.

The token symbol is the first symbolic size among the graph's non-parameter tensor inputs
(``input_ids[T]`` or ``[1, T]``). A piece reads its token count from a symbolic int input equal to
it, or from a tensor dimension equal to it; a piece that depends on another symbol gets no getter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch import fx


def _free_symbols(value: Any) -> set[sympy.Symbol]:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return set(value.node.expr.free_symbols)
    if isinstance(value, torch.Tensor):
        out: set[sympy.Symbol] = set()
        for d in (*value.shape, *value.stride()):
            if isinstance(d, torch.SymInt):
                out |= d.node.expr.free_symbols
        return out
    return set()


def find_token_symbol(gm: fx.GraphModule) -> sympy.Symbol | None:
    """Symbol of the token count in a Dynamo graph, or None when the graph has static shapes."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
            continue
        for d in value.shape:
            if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol:
                return d.node.expr
    return None


def token_count_getter(
    example_inputs: Sequence[Any], symbol: sympy.Symbol | None
) -> Callable[[tuple[Any, ...]], int] | None:
    """``f(args) -> token count`` for a piece with these (fake) inputs; None if it has none to read.

    None also when an input depends on a symbol other than the token count: such a piece has more
    than one dynamic size and cannot be captured per token-count bucket.
    """
    if symbol is None or any(_free_symbols(x) - {symbol} for x in example_inputs):
        return None
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.SymInt) and x.node.expr == symbol:
            return lambda args, i=i: int(args[i])
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            for dim, d in enumerate(x.shape):
                if isinstance(d, torch.SymInt) and d.node.expr == symbol:
                    return lambda args, i=i, dim=dim: args[i].shape[dim]
    return None
