"""Pieces compiled once more for chosen token counts with static shapes (``GraphConfig.compile_sizes``).

Every piece is compiled for a symbolic token count, so one artifact serves all sizes. Inductor then cannot
use what it would know about a fixed size: at one token a linear layer is a matrix-vector product, which
Inductor turns into a fused reduction (``coordinate_descent_tuning``; its ``mm`` decomposition asks for a
statically known 1), with the producer (RMSNorm) or consumer (residual add) of the GEMM fused in. With
``compile_sizes=(1,)`` a decoder's bs-1 decode pieces get such static artifacts; every other size keeps
the symbolic one. Standalone artifacts check no guards, so ``SizeDispatch`` calls a static artifact only
for exactly its size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch

from compile_attn.compiler.counters import compile_counters

# Config patches of the static compiles on top of the piece's own: coordinate descent is what makes Inductor
# decompose M=1 matmuls into reductions (torch/_inductor/decomposition.py, ``mm``).
STATIC_PATCHES: dict[str, Any] = {"coordinate_descent_tuning": True}


def _concrete(value: Any, symbol: sympy.Symbol, size: int) -> int:
    if isinstance(value, torch.SymInt):
        expr = value.node.expr.subs(symbol, size)
        if not expr.is_Integer:
            raise ValueError(f"size expression {value.node.expr} does not become a number at {symbol}={size}")
        return int(expr)
    return int(value)


def static_example_inputs(example_inputs: Sequence[Any], symbol: sympy.Symbol, size: int) -> list[Any]:
    """Real (uninitialised) tensors and ints standing in for a piece's fake inputs at ``symbol = size``."""
    out: list[Any] = []
    for x in example_inputs:
        if isinstance(x, torch.SymInt):
            out.append(_concrete(x, symbol, size))
        elif isinstance(x, torch.Tensor):
            shape = [_concrete(d, symbol, size) for d in x.shape]
            stride = [_concrete(s, symbol, size) for s in x.stride()]
            out.append(torch.empty_strided(shape, stride, dtype=x.dtype, device=x.device))
        else:
            out.append(x)
    return out


class SizeDispatch:
    """Runs ``static[size]`` for the token counts it was compiled at, ``general`` for every other."""

    def __init__(self, general: Callable[..., Any], static: Mapping[int, Callable[..., Any]],
                 token_count: Callable[[tuple[Any, ...]], int]) -> None:
        self.general = general
        self.static = dict(static)
        self.token_count = token_count

    def __call__(self, *args: Any) -> Any:
        fn = self.static.get(self.token_count(args))
        if fn is None:
            return self.general(*args)
        compile_counters.static_piece_calls += 1
        return fn(*args)
