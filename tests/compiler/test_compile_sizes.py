"""GraphConfig.compile_sizes: pieces compiled once more with static shapes at chosen token counts; those counts
run the static artifacts, every other count the symbolic ones, all matching eager; the static artifacts are
cached like the others."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.compiler.compile_helpers import SMALL, run_step, toy_model

from compile_attn.compiler import compile_counters
from compile_attn.compiler.compile_sizes import SizeDispatch, static_example_inputs
from compile_attn.compiler.compiled_model import compile_model
from compile_attn.config import GraphConfig


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile(model, cache_dir, sizes):  # noqa: ANN001, ANN202
    # dynamic=True: one symbolic graph for every token count >= 2 (Dynamo specialises 1 on its own; the engine's
    # CompiledModel marks the count unbacked instead, see test_unbacked_token_count_with_compile_sizes)
    return torch.compile(model, backend="compile_attn", dynamic=True,
                         options={"cache_dir": str(cache_dir), "compile_sizes": sizes})


def test_static_sizes_run_their_own_artifacts_and_match_eager(tmp_path):
    model = toy_model()
    compiled = _compile(model, tmp_path, (3, 4))
    # 4 compiled pieces per step (first, middle, middle, last; the middle ones identical): 3 unique, each also
    # compiled at 3 and at 4 tokens
    with compile_counters.expect(graphs_seen=1, floats_specialized=2, pieces_split=7, split_op_pieces=3,
                                 pieces_compiled=3, pieces_reused=1, pieces_compiled_static=6, cache_misses=9,
                                 cache_saves=9):
        out = run_step(compiled, SMALL, 5, seed=3)
    torch.testing.assert_close(out, run_step(model, SMALL, 5, seed=3), rtol=1e-5, atol=1e-5)
    for num_tokens, static_calls in ((3, 4), (4, 4), (2, 0), (7, 0)):
        with compile_counters.expect(static_piece_calls=static_calls):  # and no compile of any kind
            out = run_step(compiled, SMALL, num_tokens, seed=num_tokens)
        torch.testing.assert_close(out, run_step(model, SMALL, num_tokens, seed=num_tokens), rtol=1e-5, atol=1e-5)

    torch._dynamo.reset()  # a second start: every artifact, static ones included, comes from the cache
    again = _compile(toy_model(seed=1), tmp_path, (3, 4))
    with compile_counters.expect(graphs_seen=1, floats_specialized=2, pieces_split=7, split_op_pieces=3,
                                 pieces_reused=1, cache_hits=9, static_piece_calls=4):
        run_step(again, SMALL, 3, seed=1)


def test_unbacked_token_count_with_compile_sizes():
    """The engine's CompiledModel (unbacked token count): one token runs the pieces compiled for it."""
    model = toy_model()
    compiled = compile_model(model, {"cache_dir": None, "compile_sizes": (1,)})
    before = compile_counters.linears_as_reductions
    run_step(compiled, SMALL, 5, seed=3)
    # every linear of the unique pieces runs as a reduction at one token: fused q/k/v, o, gate/up, down per
    # layer (first piece: q/k/v; middle: o, gate/up, down, q/k/v; last: o, gate/up, down, LM head)
    assert compile_counters.linears_as_reductions - before == 1 + 4 + 4
    for num_tokens, static_calls in ((1, 4), (6, 0)):
        with compile_counters.expect(static_piece_calls=static_calls):  # no recompile at 1 token either
            out = run_step(compiled, SMALL, num_tokens, seed=num_tokens)
        torch.testing.assert_close(out, run_step(model, SMALL, num_tokens, seed=num_tokens), rtol=1e-5, atol=1e-5)


def test_static_example_inputs_substitute_the_token_count():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env) as mode:
        x = mode.from_tensor(torch.empty(5, 4), symbolic_context=None)
    s = shape_env.create_unbacked_symint()
    with mode:
        y = torch.empty(s, 4) * 2
        z = torch.empty(2 * s + 1, 3)
    symbol = s.node.expr
    inputs = static_example_inputs([y, z, s, x, 7], symbol, 3)
    assert inputs[0].shape == (3, 4) and inputs[0].stride() == (4, 1) and not isinstance(inputs[0], type(y))
    assert inputs[1].shape == (7, 3)
    assert inputs[2] == 3 and inputs[4] == 7
    assert inputs[3].shape == (5, 4)
    other = shape_env.create_unbacked_symint()  # a second dynamic size: no static stand-in exists
    with pytest.raises(ValueError, match="does not become a number"):
        static_example_inputs([s + other], symbol, 3)


def test_size_dispatch_calls_a_static_artifact_only_at_its_size():
    calls = []
    dispatch = SizeDispatch(lambda *a: calls.append(("general", len(a[0]))),
                            {1: lambda *a: calls.append(("static", len(a[0])))}, lambda args: len(args[0]))
    for n in (1, 2, 1, 3):
        dispatch([0] * n)
    assert calls == [("static", 1), ("general", 2), ("static", 1), ("general", 3)]


def test_compile_sizes_must_be_positive():
    with pytest.raises(ValueError, match="compile_sizes must be positive"):
        GraphConfig(compile_sizes=(0,))
    assert GraphConfig(compile_sizes=(4, 1, 4)).compile_sizes == (1, 4)
    with pytest.raises(TypeError, match="compile_sizes must be a sequence of integers.*got 1"):
        GraphConfig(compile_sizes=1)
    with pytest.raises(TypeError, match="decode_batch_sizes must be a sequence of integers.*got None"):
        GraphConfig(decode_batch_sizes=None)  # only compile_sizes has a None default


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("shape", [(1, 48), (1, 1, 48), (3, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_as_reduction_matches_float64(dtype, tol, shape, bias):
    from compile_attn.compiler.compile_sizes import linear_as_reduction

    gen = torch.Generator().manual_seed(sum(shape) + bias)
    x = torch.randn(shape, generator=gen).to(dtype)
    w = torch.randn(40, 48, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype) if bias else None
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    got = linear_as_reduction(x, w, b)
    assert got.dtype == dtype and got.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 4)


def _three_linears(x, table, w1, b1, w2, b2, w3, b3):  # noqa: ANN001, ANN202
    """One linear over the token rows, one over a single row, one over three rows."""
    return F.linear(x, w1, b1), F.linear(x.sum(0, keepdim=True), w2, b2), F.linear(table, w3, b3)


def _dynamo_graph(fn, *inputs):  # noqa: ANN001, ANN202
    caught = []

    def backend(gm, example_inputs):  # noqa: ANN001, ANN202
        caught.append((gm, example_inputs))
        return gm

    torch._dynamo.mark_dynamic(inputs[0], 0)
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return caught[0]


@pytest.mark.parametrize("size,rewritten", [(1, 2), (2, 1)])
def test_linears_as_reductions_rewrites_one_row_linears_only(size, rewritten):
    from compile_attn.compiler.compile_sizes import linears_as_reductions
    from compile_attn.passes.fuse_linears import LINEAR_TARGETS

    gen = torch.Generator().manual_seed(size)
    params = [torch.randn(shape, generator=gen) for shape in ((6, 8), (6,)) * 3]
    gm, example = _dynamo_graph(_three_linears, torch.randn(5, 8), torch.randn(3, 8), *params)
    symbol = next(e for e in example if isinstance(e, torch.SymInt)).node.expr
    before = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    new_gm, count = linears_as_reductions(gm, symbol, size)
    assert count == rewritten
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == before  # the input is untouched
    assert sum(n.target in LINEAR_TARGETS for n in new_gm.graph.nodes) == 3 - rewritten
    assert sum(n.target is torch.ops.aten.sum.dim_IntList for n in new_gm.graph.nodes) == rewritten
    # aten/prims overloads only: PyTorch's AOTAutograd cache takes the graph (a Python function would bypass it)
    assert all(isinstance(n.target, torch._ops.OpOverload) or n.target in LINEAR_TARGETS or n.op != "call_function"
               for n in new_gm.graph.nodes)
    x, table = torch.randn(size, 8, generator=gen), torch.randn(3, 8, generator=gen)
    by_name = dict(zip(("x", "table", "w1", "b1", "w2", "b2", "w3", "b3"), (x, table, *params)))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = [size if isinstance(e, torch.SymInt) else by_name[n.name[2:-1]]  # l_w1_ -> w1
              for n, e in zip(placeholders, example)]
    want = [x.double() @ params[0].double().T + params[1].double(),
            x.double().sum(0, keepdim=True) @ params[2].double().T + params[3].double(),
            table.double() @ params[4].double().T + params[5].double()]
    for got, ref in zip(new_gm(*inputs), want):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_compile_sizes_left_to_the_device():
    from compile_attn.config import AUTO_GPU_COMPILE_SIZES, parse_compile_sizes

    auto = GraphConfig()
    assert auto.compile_sizes is None
    assert auto.static_compile_sizes(on_cuda=True) == AUTO_GPU_COMPILE_SIZES == (1,)
    assert auto.static_compile_sizes(on_cuda=False) == ()
    assert GraphConfig(compile_sizes=()).static_compile_sizes(on_cuda=True) == ()
    assert GraphConfig(compile_sizes=(2,)).static_compile_sizes(on_cuda=False) == (2,)
    assert parse_compile_sizes("auto") is None
    assert parse_compile_sizes("none") == parse_compile_sizes("") == ()
    assert parse_compile_sizes("4,1") == (4, 1)
    with pytest.raises(ValueError, match="'1;2'"):
        parse_compile_sizes("1;2")


def test_static_inductor_config_reaches_the_static_compiles_only(tmp_path, monkeypatch):
    from compile_attn.compiler.compile_sizes import STATIC_PATCHES
    from compile_attn.compiler.piece_compiler import PieceCompiler

    seen = []  # (static compile?, patches) of every piece compile
    real = PieceCompiler._load_or_compile

    def recording(self, gm, key, example_inputs, patches, compile_fn):  # noqa: ANN001, ANN202
        seen.append(("@" in key.digest, dict(patches)))
        return real(self, gm, key, example_inputs, patches, compile_fn)

    monkeypatch.setattr(PieceCompiler, "_load_or_compile", recording)
    model = toy_model()
    options = {"cache_dir": str(tmp_path), "compile_sizes": (3,), "inductor_config": {"combo_kernels": True},
               "static_inductor_config": {"triton.enable_pdl": True, "realize_opcount_threshold": 4}}
    compiled = torch.compile(model, backend="compile_attn", dynamic=True, options=options)
    for tokens in (3, 5):  # the static artifact, then the symbolic one
        torch.testing.assert_close(run_step(compiled, SMALL, tokens, seed=1), run_step(model, SMALL, tokens, seed=1))
    assert {static for static, _ in seen} == {True, False}
    for static, patches in seen:
        assert patches["combo_kernels"] is True
        if static:  # the caller's static patches over STATIC_PATCHES
            assert patches["triton.enable_pdl"] is True and patches["realize_opcount_threshold"] == 4
        else:
            assert "triton.enable_pdl" not in patches
            assert patches.get("realize_opcount_threshold") != STATIC_PATCHES["realize_opcount_threshold"]
    with pytest.raises(ValueError, match="static_inductor_config.*no_such_option"):
        GraphConfig(static_inductor_config={"no_such_option": 1})
