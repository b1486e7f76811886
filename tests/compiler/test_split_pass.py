"""The split pass on Dynamo graphs: piece boundaries, split-op grouping, size expressions, equivalence."""

from __future__ import annotations

import pytest
import torch
from tests.compiler.compile_helpers import SMALL, GatedMLP, GraphCatcher, run_step, toy_model

import compile_attn
from compile_attn.passes import assign_pieces, split_graph

torch.library.define("split_test::scale3", "(Tensor x, Tensor(a!) out) -> ()")


@torch.library.impl("split_test::scale3", "CompositeExplicitAutograd")
def _scale3(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * 3)


@torch.library.register_fake("split_test::scale3")
def _scale3_fake(x: torch.Tensor, out: torch.Tensor) -> None:
    return None


@pytest.fixture
def scale3_is_split_op():
    compile_attn.register_split_op("split_test::scale3")
    yield
    compile_attn.ops.unregister_split_op("split_test::scale3")


def _dynamo_graph(fn, *args) -> torch.fx.GraphModule:
    catcher = GraphCatcher()
    torch._dynamo.reset()
    torch.compile(fn, backend=catcher, dynamic=True, fullgraph=True)(*args)
    assert len(catcher.graphs) == 1
    return catcher.graphs[0]


class SplittingBackend:
    """A Dynamo backend that splits the graph and runs the stitched module with every piece eager."""

    def __init__(self) -> None:
        self.splits = []

    def __call__(self, gm, example_inputs):
        self.splits.append(split_graph(gm))
        return self.splits[-1].split_gm


def _split_and_run(fn, *args):
    backend = SplittingBackend()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(specialize_float=True):
        out = torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)(*args)
    assert len(backend.splits) == 1
    return backend.splits[0], out


def test_toy_decoder_splits_at_every_attention_and_still_computes_the_same():
    model = toy_model()
    backend = SplittingBackend()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(specialize_float=True):
        split_out = run_step(torch.compile(model, backend=backend, dynamic=True), SMALL, 9, seed=1)
    split = backend.splits[0]
    kinds = [p.is_split_op for p in split.pieces]
    assert kinds == [False, True] * SMALL.num_layers + [False]
    for piece in split.split_op_pieces:
        assert piece.op_labels == ["compile_attn::attention"]
    for piece in split.compiled_pieces:
        assert "compile_attn::attention" not in piece.op_labels
    torch.testing.assert_close(split_out, run_step(model, SMALL, 9, seed=1), rtol=1e-6, atol=1e-6)


def test_graph_without_split_op_is_one_piece():
    model = GatedMLP()
    split = split_graph(_dynamo_graph(model, torch.randn(5, 32)))
    assert len(split.pieces) == 1 and not split.pieces[0].is_split_op


def test_consecutive_split_ops_share_one_piece(scale3_is_split_op):
    def f(x):
        y = torch.relu(x)
        a, b = torch.empty_like(y), torch.empty_like(y)
        torch.ops.split_test.scale3(y, a)
        torch.ops.split_test.scale3(y, b)
        return a + b

    x = torch.randn(6, 4)
    split, out = _split_and_run(f, x)
    assert [p.is_split_op for p in split.pieces] == [False, True, False]
    assert split.pieces[1].op_labels == ["split_test::scale3", "split_test::scale3"]
    torch.testing.assert_close(out, f(x))


def test_graph_starting_with_a_split_op(scale3_is_split_op):
    def f(x, out):
        torch.ops.split_test.scale3(x, out)
        return out + 1

    gm = _dynamo_graph(f, torch.randn(4, 2), torch.empty(4, 2))
    pieces = assign_pieces(gm.graph)
    first_call = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert pieces[first_call] == 0 and max(pieces.values()) == 1


def test_size_expressions_do_not_cross_piece_boundaries(scale3_is_split_op):
    def f(x):
        n = x.shape[0] * 2  # a derived size, computed before the split op, used after it
        shape = x.size()  # a whole torch.Size, used after the split op
        y = torch.relu(x)
        out = torch.empty_like(y)
        torch.ops.split_test.scale3(y, out)
        return out.reshape(n // 2, -1) + x.new_zeros(shape) + n

    x = torch.randn(6, 4)
    split, out = _split_and_run(f, x)
    for piece in split.pieces:  # every value a piece hands to another one is a tensor
        output = next(n for n in piece.graph_module.graph.nodes if n.op == "output")
        returned = torch.fx.node.map_aggregate(output.args[0], lambda a: a)
        for node in torch.utils._pytree.tree_leaves(returned):
            value = node.meta.get("example_value")
            what = type(value).__name__
            assert isinstance(value, torch.Tensor), f"{piece.name} returns {node.name}: {what}"
    torch.testing.assert_close(out, f(x))
