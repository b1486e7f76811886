"""Split-op pieces of a compiled model call the op's registered Python body, not ``torch.ops``."""

from __future__ import annotations

import torch
from torch import fx

import compile_attn
from compile_attn.compiler.shortcuts import direct_split_piece
from compile_attn.ops.attention import attention as attention_body

torch.library.define("direct_test::double", "(Tensor x, Tensor(a!) out) -> ()")
_BODY_CALLS: list[int] = []


def _double(x: torch.Tensor, out: torch.Tensor) -> None:
    _BODY_CALLS.append(1)
    out.copy_(x * 2)


torch.library.impl("direct_test::double", "CompositeExplicitAutograd")(_double)


def _piece(op) -> fx.GraphModule:  # noqa: ANN001
    graph = fx.Graph()
    x, out = graph.placeholder("x"), graph.placeholder("out")
    graph.call_function(op, (x, out))
    graph.output(out)
    return fx.GraphModule(torch.nn.Module(), graph)


def test_registered_body_is_called_directly_and_the_piece_is_unchanged():
    op = torch.ops.direct_test.double.default
    compile_attn.register_split_op(op, python_impl=_double)
    try:
        gm = _piece(op)
        fn, redirected = direct_split_piece(gm)
    finally:
        compile_attn.ops.unregister_split_op(op)
    assert redirected == 1
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [op]  # the original keeps the op
    x, out = torch.arange(4.0), torch.zeros(4)
    _BODY_CALLS.clear()
    seen: list[object] = []

    class Seen(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Seen():
        result = fn(x, out)
    assert torch.equal(result, torch.arange(4.0) * 2) and _BODY_CALLS == [1]
    assert op not in seen  # the dispatcher never saw the split op; the body's aten ops it did
    assert torch.ops.aten.copy_.default in seen


def test_ops_without_a_body_keep_their_torch_ops_call():
    op = torch.ops.direct_test.double.default
    compile_attn.register_split_op(op)  # no python_impl
    try:
        gm = _piece(op)
        fn, redirected = direct_split_piece(gm)
    finally:
        compile_attn.ops.unregister_split_op(op)
    assert redirected == 0 and fn == gm.forward
    x, out = torch.arange(3.0), torch.zeros(3)
    assert torch.equal(fn(x, out), x * 2)


def test_attention_op_has_its_body_registered():
    fn, redirected = direct_split_piece(_attention_piece())
    assert redirected == 1
    assert any(n.target is attention_body for n in fn.__self__.graph.nodes)


def _attention_piece() -> fx.GraphModule:
    graph = fx.Graph()
    q, k, v, out = (graph.placeholder(n) for n in ("q", "k", "v", "out"))
    graph.call_function(torch.ops.compile_attn.attention.default, (q, k, v, out, 0))
    graph.output(out)
    return fx.GraphModule(torch.nn.Module(), graph)
