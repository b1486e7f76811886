"""FX graph passes run by the compile backend: float specialization, size-expression decomposition, split.

Each pass takes a Dynamo FX graph and changes or cuts it; none compiles or runs anything.
"""

from compile_attn.passes.scalars import specialize_tensorified_floats
from compile_attn.passes.size_exprs import decompose_size_exprs
from compile_attn.passes.split import Piece, SplitGraph, assign_pieces, is_split_node, split_graph

__all__ = [
    "Piece",
    "SplitGraph",
    "assign_pieces",
    "decompose_size_exprs",
    "is_split_node",
    "specialize_tensorified_floats",
    "split_graph",
]
