"""Fusion of shared-input linear layers (q/k/v, gate/up): same outputs, one GEMM, no duplicated weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import compile_attn
from compile_attn.compiler import compile_counters
from compile_attn.compiler.backend import compile_attn_backend

torch.library.define("fuse_test::double", "(Tensor x, Tensor(a!) out) -> ()")


@torch.library.impl("fuse_test::double", "CompositeExplicitAutograd")
def _double(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * 2)


@torch.library.register_fake("fuse_test::double")
def _double_fake(x: torch.Tensor, out: torch.Tensor) -> None:
    return None


@pytest.fixture
def double_is_split_op():
    compile_attn.register_split_op("fuse_test::double")
    yield
    compile_attn.ops.unregister_split_op("fuse_test::double")


class Block(nn.Module):
    """q/k/v (GQA-like widths) read one normed input, gate/up another; ``o`` reads neither."""

    def __init__(self, bias: bool = False, split_between: bool = False) -> None:
        super().__init__()
        self.norm, self.mlp_norm = nn.LayerNorm(16), nn.LayerNorm(16)
        self.q, self.k, self.v = nn.Linear(16, 32, bias), nn.Linear(16, 8, bias), nn.Linear(16, 8, bias)
        self.gate, self.up = nn.Linear(16, 24, bias=False), nn.Linear(16, 24, bias=False)
        self.o = nn.Linear(64, 16, bias=False)
        self.split_between = split_between

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, m = self.norm(x), self.mlp_norm(x)
        q, k, v = self.q(h).view(-1, 4, 8), self.k(h).view(-1, 1, 8), self.v(h)
        if self.split_between:  # a split op between gate and up: they land in different pieces
            g = self.gate(m)
            doubled = torch.empty_like(g)
            torch.ops.fuse_test.double(g, doubled)
            mlp = torch.nn.functional.silu(doubled) * self.up(m)
        else:
            mlp = torch.nn.functional.silu(self.gate(m)) * self.up(m)
        attn = (q * k).flatten(1)
        return self.o(torch.cat([attn, v, mlp - v.repeat(1, 3)], dim=-1))


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _compile(model: nn.Module, **options) -> nn.Module:
    torch._dynamo.reset()
    options = {"compiler": "eager", "cache_dir": None, **options}
    return torch.compile(model, backend=compile_attn_backend, options=options, dynamic=True)


def _run(model: nn.Module, x: torch.Tensor, **options) -> tuple[torch.Tensor, dict[str, int]]:
    before = compile_counters.snapshot()
    with torch.no_grad():
        out = _compile(model, **options)(x)
    return out, compile_counters.delta(before)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_block_equals_unfused(compiler: str, bias: bool) -> None:
    torch.manual_seed(0)
    model = Block(bias=bias).eval()
    reference = Block(bias=bias).eval()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(5, 16, dtype=torch.float32)
    out, delta = _run(model, x, compiler=compiler)
    assert delta.get("linear_groups_fused") == 2, delta  # q/k/v and gate/up; o reads another input
    with torch.no_grad():
        torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-5)
        x7 = torch.randn(7, 16)  # another token count: the same fused graph
        torch.testing.assert_close(_compile(model, compiler=compiler)(x7), reference(x7), rtol=1e-5, atol=1e-5)


def test_unbacked_token_count() -> None:
    """The engine's CompiledModel marks the token dimension unbacked: fusion works on that graph too."""
    from torch._dynamo.decorators import mark_unbacked

    torch.manual_seed(0)
    model, reference = Block().eval(), Block().eval()
    reference.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=compile_attn_backend, options={"compiler": "inductor", "cache_dir": None})
    before = compile_counters.snapshot()
    with torch.no_grad():
        for n in (1, 6):
            x = torch.randn(n, 16)
            mark_unbacked(x, 0)
            torch.testing.assert_close(compiled(x), reference(x), rtol=1e-5, atol=1e-5)
    assert compile_counters.delta(before).get("linear_groups_fused") == 2


def test_fused_parameters_are_views_of_one_tensor() -> None:
    torch.manual_seed(0)
    model = Block(bias=True).eval()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    _run(model, torch.randn(3, 16))
    q, k, v = model.q.weight, model.k.weight, model.v.weight
    assert _storage_ptr(q) == _storage_ptr(k) == _storage_ptr(v)
    assert (k.storage_offset(), v.storage_offset()) == (q.numel(), q.numel() + k.numel())
    assert _storage_ptr(model.q.bias) == _storage_ptr(model.v.bias)
    assert _storage_ptr(model.gate.weight) == _storage_ptr(model.up.weight)
    assert _storage_ptr(model.o.weight) != _storage_ptr(q)
    # nothing duplicated: the fused storages hold exactly the parameters they replaced
    assert q.untyped_storage().nbytes() == (q.numel() + k.numel() + v.numel()) * q.element_size()
    for name, p in model.named_parameters():  # values unchanged, still Parameters of the model
        assert isinstance(p, nn.Parameter)
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0)


def test_recompile_reuses_the_fused_storage() -> None:
    torch.manual_seed(0)
    model = Block().eval()
    _run(model, torch.randn(3, 16))
    ptr = _storage_ptr(model.q.weight)
    out, delta = _run(model, torch.randn(4, 16))  # _compile resets Dynamo: a second, fresh compile
    assert delta.get("linear_groups_fused") == 2
    assert _storage_ptr(model.q.weight) == ptr


def test_load_state_dict_after_compile_reaches_the_fused_weight() -> None:
    torch.manual_seed(0)
    model = Block().eval()
    compiled = _compile(model)
    x = torch.randn(3, 16)
    with torch.no_grad():
        compiled(x)
        other = Block().eval()
        model.load_state_dict(other.state_dict())  # copies into the parameters, views of the fused tensor
        torch.testing.assert_close(compiled(x), other(x), rtol=1e-5, atol=1e-5)


def test_nothing_fused_when_autograd_needs_the_parameters() -> None:
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(3, 16)
    before = compile_counters.snapshot()
    out = _compile(model)(x)
    out.sum().backward()
    assert compile_counters.delta(before).get("linear_groups_fused", 0) == 0
    assert _storage_ptr(model.q.weight) != _storage_ptr(model.k.weight)
    assert model.k.weight.grad is not None and model.k.weight.grad.abs().sum() > 0


def test_option_off_fuses_nothing() -> None:
    model = Block().eval()
    _, delta = _run(model, torch.randn(3, 16), fuse_linears=False)
    assert delta.get("linear_groups_fused", 0) == 0
    assert _storage_ptr(model.q.weight) != _storage_ptr(model.k.weight)


def test_tensor_arguments_are_not_fused() -> None:
    """Weights passed as arguments may change between calls: only module parameters are fused."""

    def f(x, w1, w2):
        return torch.nn.functional.linear(x, w1), torch.nn.functional.linear(x, w2)

    x, w1, w2 = torch.randn(3, 8), torch.randn(4, 8), torch.randn(4, 8)
    before = compile_counters.snapshot()
    with torch.no_grad():
        torch._dynamo.reset()
        compiled = torch.compile(f, backend=compile_attn_backend, options={"compiler": "eager", "cache_dir": None})
        compiled(x, w1, w2)
        w3 = torch.randn(4, 8)
        torch.testing.assert_close(compiled(x, w1, w3)[1], x @ w3.T)
    assert compile_counters.delta(before).get("linear_groups_fused", 0) == 0


def test_linears_on_both_sides_of_a_split_op_are_not_fused(double_is_split_op) -> None:
    torch.manual_seed(0)
    model = Block(split_between=True).eval()
    reference = Block(split_between=True).eval()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(5, 16)
    out, delta = _run(model, x)
    # q/k/v fuse; gate runs before the split op and up after it, so they stay two GEMMs
    assert delta.get("linear_groups_fused") == 1, delta
    assert delta.get("split_op_pieces") == 1, delta
    assert _storage_ptr(model.k.weight) == _storage_ptr(model.q.weight)
    assert _storage_ptr(model.up.weight) != _storage_ptr(model.gate.weight)
    with torch.no_grad():
        torch.testing.assert_close(out, reference(x), rtol=1e-5, atol=1e-5)


def test_a_second_model_of_the_same_class_is_stopped_not_given_the_first_ones_weights() -> None:
    """Dynamo reuses the first model's compiled code for a second model of the same class (its guards pass); that
    code computes with the first model's fused weights, so the call is refused with an error naming the way out."""
    torch.manual_seed(0)
    first, second = Block().eval(), Block().eval()
    torch._dynamo.reset()
    options = {"compiler": "eager", "cache_dir": None}
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(first, backend=compile_attn_backend, options=options)(x), first(x))
        compiled_second = torch.compile(second, backend=compile_attn_backend, options=options)
        with pytest.raises(compile_attn.CompileAttnError, match="compile_model"):
            compiled_second(x)
        torch._dynamo.reset()  # the way out the error names: a fresh compile for the second model
        torch.testing.assert_close(compiled_second(x), second(x), rtol=1e-5, atol=1e-5)
