"""Host shortcuts: each trick that leans on another library's internals is pinned here (a torch or Triton upgrade
that changes them fails a test, not a user), and the one switch ``COMPILE_ATTN_HOST_SHORTCUTS=0`` turns every
shortcut off (tests/graph_runner/test_gr_shortcuts.py runs every layer both ways). Triton's launch form
(``CachedLaunch``) is pinned in tests/attention/kernels/test_cached_launch.py."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from compile_attn.compiler.shortcuts import install_piece, record_graph_calls
from compile_attn.env import HOST_SHORTCUTS_ENV, host_shortcuts_enabled
from compile_attn.graph_runner.shortcuts import CAN_SKIP_GUARDS, RECOMPILE_REFUSED, skipped_guards
from compile_attn.ops.attention import attention as attention_body
from compile_attn.ops.split_registry import split_op_python_impl


# ---------------------------------------------------------------------------------------- torch internals, pinned
def test_dynamo_refuses_a_recompile_under_skipped_guards_with_the_text_the_runner_matches() -> None:
    """graph_runner/shortcuts.py: ``set_stance(skip_guard_eval_unsafe=True)`` exists, and a call that needs a new
    graph raises a RuntimeError whose text names the stance (the runner then retries with guards)."""
    assert CAN_SKIP_GUARDS
    torch._dynamo.reset()
    calls: list[int] = []

    def backend(gm: fx.GraphModule, example_inputs: list) -> object:
        calls.append(1)
        return gm.forward

    fn = torch.compile(lambda x: x * 2 + 1, backend=backend, dynamic=False)
    fn(torch.ones(3))
    with skipped_guards():
        assert torch.equal(fn(torch.ones(3)), torch.full((3,), 3.0))  # same graph, guards skipped
        with pytest.raises(RuntimeError, match=RECOMPILE_REFUSED):
            fn(torch.ones(3, dtype=torch.float64))  # a dtype no graph has seen: needs a recompile
    assert len(calls) == 1
    assert not torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe  # the stance is restored
    torch._dynamo.reset()


def test_an_instance_dict_entry_shadows_a_submodule_in_the_generated_forward() -> None:
    """compiler/shortcuts.install_piece: a GraphModule's ``self.submod_0(...)`` finds the instance ``__dict__``
    before ``nn.Module.__getattr__`` looks in ``_modules``; the plain path replaces the submodule instead."""
    for shortcuts in (True, False):
        gm = _split_module()
        original = gm.submod_0
        calls: list[int] = []

        def piece(x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            return x + 10

        install_piece(gm, "submod_0", piece, shortcuts)
        assert torch.equal(gm(torch.zeros(2)), torch.full((2,), 20.0)) and calls == [1]
        assert (gm._modules["submod_0"] is original) == shortcuts


def _split_module() -> fx.GraphModule:
    """``submod_0(x) * 2`` with ``submod_0 = x + 1``, called as a submodule, as split_module makes them."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.mul, (graph.call_module("submod_0", (x,)), 2)))
    root = torch.nn.Module()
    root.submod_0 = fx.symbolic_trace(lambda x: x + 1)
    return fx.GraphModule(root, graph)


def test_the_attention_ops_only_kernel_is_its_registered_python_body() -> None:
    """compiler/shortcuts.direct_split_piece calls the body given to ``register_split_op`` instead of
    ``torch.ops``: that is only the same if the op has one kernel, CompositeExplicitAutograd, running that body."""
    name = "compile_attn::attention"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")
    for key in ("CPU", "CUDA", "Autograd", "AutogradCPU", "AutogradCUDA"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, key), key
    assert split_op_python_impl(torch.ops.compile_attn.attention.default) is attention_body


def test_custom_op_bodies_are_where_the_cpu_full_graph_tape_finds_them() -> None:
    """graph_runner/breakable.py descends into split ops defined with ``torch.library.custom_op`` through
    ``torch._library.custom_ops.OPDEFS[name]._init_fn``."""
    from torch._library.custom_ops import OPDEFS

    @torch.library.custom_op("shortcut_pin::scale", mutates_args=())
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    op = torch.ops.shortcut_pin.scale.default
    assert OPDEFS[op._schema.name]._init_fn is scale._init_fn
    assert torch.equal(OPDEFS[op._schema.name]._init_fn(torch.ones(2)), torch.full((2,), 3.0))


# ---------------------------------------------------------------------------------------- the switch
def test_the_switch_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, on in (("0", False), ("off", False), ("no", False), ("1", True), ("", True)):
        monkeypatch.setenv(HOST_SHORTCUTS_ENV, value)
        assert host_shortcuts_enabled() is on
    monkeypatch.delenv(HOST_SHORTCUTS_ENV)
    assert host_shortcuts_enabled()


def test_graph_entry_is_what_dynamo_calls() -> None:
    """The compile backend's GraphEntry is called by Dynamo once per model call with the graph's flat inputs."""
    torch._dynamo.reset()
    if not host_shortcuts_enabled():
        pytest.skip(f"{HOST_SHORTCUTS_ENV}=0: the backend returns the split module itself")
    fn = torch.compile(lambda x, y: torch.relu(x) + y, backend="compile_attn", options={"compiler": "eager"})
    x, y = torch.randn(4), torch.randn(4)
    with record_graph_calls() as calls:
        out = fn(x, y)
    assert len(calls) == 1 and calls[0].args[0] is x
    assert torch.equal(calls[0].outputs[0], out) and calls[0].fn.__name__ == "forward"
    torch._dynamo.reset()
