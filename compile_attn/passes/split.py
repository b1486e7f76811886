"""Split a Dynamo FX graph at every registered split op (attention) into an ordered list of pieces.

Pieces alternate: compiled pieces hold everything between split ops, split-op pieces hold one or
more consecutive split ops and run eagerly. The cut uses ``torch.fx.passes.split_module`` with
``keep_original_order=True``; a graph without split ops is a single piece. This pass compiles nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import fx
from torch.fx.passes.split_module import split_module

from compile_attn.ops import is_split_op, op_name
from compile_attn.passes.size_exprs import decompose_size_exprs


def is_split_node(node: fx.Node) -> bool:
    """True for a call of a registered split op (see ``compile_attn.register_split_op``)."""
    return node.op == "call_function" and is_split_op(node.target)


def node_label(node: fx.Node) -> str:
    """Short readable name of what a call node does: ``aten.mm.default``, ``linear``, ``Tensor.view``."""
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_module":
        return f"module:{node.target}"
    name = op_name(node.target)
    if name is not None:
        return name
    return getattr(node.target, "__name__", str(node.target))


@dataclass(frozen=True)
class Piece:
    """One piece of a split graph: ``split_gm.<name>`` called at position ``index``."""

    index: int
    name: str
    graph_module: fx.GraphModule
    is_split_op: bool

    @property
    def op_labels(self) -> list[str]:
        return [node_label(n) for n in self.graph_module.graph.nodes if n.op.startswith("call_")]


@dataclass
class SplitGraph:
    """The stitched module (``split_gm(*graph_inputs)`` runs every piece in order) and its pieces."""

    split_gm: fx.GraphModule
    pieces: list[Piece]

    @property
    def compiled_pieces(self) -> list[Piece]:
        return [p for p in self.pieces if not p.is_split_op]

    @property
    def split_op_pieces(self) -> list[Piece]:
        return [p for p in self.pieces if p.is_split_op]


def assign_pieces(
    graph: fx.Graph, should_split: Callable[[fx.Node], bool] = is_split_node
) -> dict[fx.Node, int]:
    """Piece index of every call node: a new piece starts at each run of split ops and right after it."""
    node_to_piece: dict[fx.Node, int] = {}
    piece, in_split_run = 0, False
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        splits = should_split(node)
        if splits != in_split_run and node_to_piece:
            piece += 1
        in_split_run = splits
        node_to_piece[node] = piece
    return node_to_piece


def split_graph(gm: fx.GraphModule, should_split: Callable[[fx.Node], bool] = is_split_node) -> SplitGraph:
    """Cut ``gm`` (modified in place: size expressions are decomposed first) into pieces."""
    node_to_piece = assign_pieces(gm.graph, should_split)
    decompose_size_exprs(gm, node_to_piece)
    split_gm = split_module(
        gm, gm, lambda node: node_to_piece[node], keep_original_order=True, keep_original_node_name=True
    )
    pieces = []
    for node in (n for n in split_gm.graph.nodes if n.op == "call_module"):
        sub = getattr(split_gm, node.target)
        has_split = any(should_split(n) for n in sub.graph.nodes)
        pieces.append(Piece(len(pieces), str(node.target), sub, has_split))
    return SplitGraph(split_gm, pieces)
