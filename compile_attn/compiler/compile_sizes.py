"""Pieces compiled once more for chosen token counts with static shapes (``GraphConfig.compile_sizes``).

Every piece is compiled for a symbolic token count, so one artifact serves all sizes. Inductor then cannot
use what it would know about a fixed size: at one token a linear layer is a matrix-vector product, bound by
reading its weight, which cuBLAS runs well below the memory bandwidth for small weights. For a static
compile, ``linears_as_reductions`` writes every linear whose input has one row as a multiply-and-sum in fp32
(what Inductor's own ``mm`` decomposition does, but only under ``coordinate_descent_tuning``, whose tuning
runs again in every process and costs start time); Inductor turns it into one reduction kernel per linear
(benchmarks/bench_gemv.py), or, by default (``env.gemv_kernel``), calls ``compile_attn.gemv``, a Triton
matrix-vector kernel that reads the weight faster still (benchmarks/sweep_gemv.py). ``STATIC_PATCHES`` keeps a
producer with more than a few ops (RMSNorm, SiLU * up) out of that kernel: inlined, it was recomputed by every program of the reduction (docs/performance.md);
``GraphConfig.static_inductor_config`` adds patches of the caller's for these compiles only. With
``compile_sizes=(1,)`` a decoder's bs-1 decode pieces get such static artifacts; every other size keeps the
symbolic one. Standalone artifacts check no guards, so ``SizeDispatch`` calls a static artifact only for
exactly its size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch
from torch import fx

import compile_attn.ops.gemv  # noqa: F401  (registers torch.ops.compile_attn.gemv)
from compile_attn.compiler.counters import compile_counters
from compile_attn.passes.fuse_linears import LINEAR_TARGETS

# Inductor config patches of the static compiles, over the piece's own. ``realize_opcount_threshold`` (default
# 30): a pointwise producer with more ops than this is computed into a buffer instead of being inlined into its
# consumers. 8 gave the fastest bs-1 decode graph of the values tried, as fast as coordinate descent tuning
# without its start-time cost (docs/performance.md).
STATIC_PATCHES: dict[str, Any] = {"realize_opcount_threshold": 8}


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


def linear_as_reduction(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` as a multiply-and-sum over ``in_features`` in fp32, rounded once to the
    input's dtype (cuBLAS also accumulates bf16 products in fp32). For a one-row input Inductor compiles it to
    one reduction kernel that reads the weight once; for more rows it would read the weight once per row."""
    out = (input.float().unsqueeze(-2) * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(input.dtype)


def _rows(node: fx.Node, symbol: sympy.Symbol, size: int) -> int | None:
    """Rows of the linear input ``node`` at ``symbol = size`` (from its traced example value), or None."""
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    rows = 1
    for dim in value.shape[:-1]:
        rows *= dim
    try:
        return _concrete(rows, symbol, size)
    except ValueError:  # a size that does not follow the token count
        return None


def _linear_operands(node: fx.Node) -> tuple[Any, Any, Any]:
    """(input, weight, bias) of a ``F.linear`` call node, wherever they were passed."""
    args = list(node.args) + [None] * (3 - len(node.args))
    return (node.kwargs.get("input", args[0]), node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2]))


def _out_dtype(node: fx.Node) -> torch.dtype | None:
    value = node.meta.get("example_value", node.meta.get("val"))
    return value.dtype if isinstance(value, torch.Tensor) else None


def _emit_linear_as_reduction(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    """The ops of ``linear_as_reduction`` for the linear call ``node``, inserted before it, as aten/prims
    overloads: PyTorch's AOTAutograd cache serialises graphs of those, where a call of a Python function
    (``linear_as_reduction`` itself) makes it skip the graph, and then the piece cannot be saved."""
    aten, convert = torch.ops.aten, torch.ops.prims.convert_element_type.default
    rows, weight, bias = _linear_operands(node)
    with graph.inserting_before(node):
        x = graph.call_function(aten.unsqueeze.default, (graph.call_function(convert, (rows, torch.float32)), -2))
        w = graph.call_function(convert, (weight, torch.float32))
        out = graph.call_function(aten.sum.dim_IntList, (graph.call_function(aten.mul.Tensor, (x, w)), [-1]))
        if bias is not None:
            out = graph.call_function(aten.add.Tensor, (out, graph.call_function(convert, (bias, torch.float32))))
        return graph.call_function(convert, (out, dtype))


def _emit_gemv(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    """A ``compile_attn.gemv`` call for the linear call ``node``, inserted before it (``dtype`` is the linear's,
    which the op keeps: it returns its input's dtype)."""
    rows, weight, bias = _linear_operands(node)
    with graph.inserting_before(node):
        return graph.call_function(torch.ops.compile_attn.gemv.default, (rows, weight, bias))


def linears_as_reductions(gm: fx.GraphModule, symbol: sympy.Symbol, size: int,
                          use_gemv: bool = False) -> tuple[fx.GraphModule, int]:
    """``gm`` with every linear call whose input has one row at ``symbol = size`` computed as
    ``linear_as_reduction`` does, or through ``compile_attn.gemv`` where ``use_gemv`` (a new module when any is;
    ``gm`` itself is left as it is), and how many calls were rewritten. The rewritten graph calls aten/prims and
    registered custom ops only, so its compiled artifact can be saved."""
    targets = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in LINEAR_TARGETS
               and _rows(_linear_operands(n)[0], symbol, size) == 1 and _out_dtype(n) is not None]
    if not targets:
        return gm, 0
    emit = _emit_gemv if use_gemv else _emit_linear_as_reduction
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    for node in targets:
        new = env[node]
        out = emit(graph, new, _out_dtype(node))
        out.meta = dict(new.meta)  # the linear's value: what the cache's checks of method calls on it look for
        new.replace_all_uses_with(out)
        graph.erase_node(new)
    return fx.GraphModule(gm, graph), len(targets)
