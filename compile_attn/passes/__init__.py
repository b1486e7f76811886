"""FX graph passes run by the compile backend: float specialization, linear fusion, size-expression
decomposition, split.

Each pass takes a Dynamo FX graph and changes or cuts it; none compiles anything. Linear fusion is the
one that touches real tensors: it concatenates the fused weights once (see ``fuse_linears``).
"""

from compile_attn.passes.fuse_linears import FusedWeight, bind_fused_weights, fuse_linears
from compile_attn.passes.scalars import specialize_tensorified_floats
from compile_attn.passes.size_exprs import decompose_size_exprs
from compile_attn.passes.split import Piece, SplitGraph, assign_pieces, is_split_node, split_graph

__all__ = [
    "FusedWeight",
    "Piece",
    "SplitGraph",
    "assign_pieces",
    "bind_fused_weights",
    "decompose_size_exprs",
    "fuse_linears",
    "is_split_node",
    "specialize_tensorified_floats",
    "split_graph",
]
