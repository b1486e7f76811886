"""torch.compile'd models: piecewise runs the compiled model with graph_mode "piecewise" (the compile
backend's wrappers capture inside it), and full graphs capture the compiled model whole."""

from __future__ import annotations

import contextlib

import pytest
import torch
from tests.graph_runner.gr_helpers import CountingBackend, Twin, eager_reference, make_model, run_scenario

from compile_attn.env import host_shortcuts_enabled
from compile_attn.config import GraphConfig
from compile_attn.context import forward_context
from compile_attn.graph_mode import GraphMode
from compile_attn.graph_runner import GraphRunner
from compile_attn.graph_runner import shortcuts as shortcuts_module


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_compiled_model_matches_eager(mode: str) -> None:
    model = make_model()
    compiled = torch.compile(model, backend="eager", dynamic=True)
    twin = Twin(seed=21)
    layers = model.attention_layers()
    backend = CountingBackend(twin.caches[0], layers)
    config = GraphConfig(
        mode=mode, decode_batch_sizes=(1, 2, 4), extend_token_sizes=(16, 32), cache_dir=None
    )
    runner = GraphRunner(compiled, backend, config, max_batch_size=4, max_num_tokens=32)
    assert runner.plan.extend is GraphMode.PIECEWISE
    runner.capture()
    piecewise_buckets = {b for m, b in runner.capture_keys() if m is GraphMode.PIECEWISE}
    assert runner.stats.captures["piecewise"] == len(piecewise_buckets)
    backend.calls.clear()
    run_scenario(
        runner,
        model,
        CountingBackend(twin.caches[1], layers),
        twin,
        [("extend", 20), ("decode", 3), ("extend", 9), ("decode", 4), ("decode", 1)],
    )
    modes = {c[2] for c in backend.calls if c[0] == "forward"}
    expected = {"piecewise", "none"} if mode == "piecewise" else {"piecewise", "none", "full"}
    assert modes <= expected and "piecewise" in modes


NEEDS_SHORTCUTS = pytest.mark.skipif(not host_shortcuts_enabled(),
                                     reason="checks a host shortcut; COMPILE_ATTN_HOST_SHORTCUTS=0 turns it off")


@NEEDS_SHORTCUTS
def test_piecewise_steps_skip_dynamo_guards_and_fall_back_to_guards_on_a_recompile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GraphConfig.skip_guards: after capture, piecewise steps call the compiled model with guard evaluation off
    and match eager. A call that would need a new graph (torch raises under skip_guard_eval_unsafe) is run again
    with guards, correctly, and guards stay on from then on."""
    torch._dynamo.reset()  # other tests' entries for the same model code would sit in Dynamo's cache
    model = make_model()
    compiled = torch.compile(model, backend="eager", dynamic=True)
    twin = Twin(seed=5)
    layers = model.attention_layers()
    backend = CountingBackend(twin.caches[0], layers)
    ref_backend = CountingBackend(twin.caches[1], layers)
    config = GraphConfig(mode="piecewise", decode_batch_sizes=(1, 2, 4), extend_token_sizes=(16, 32), cache_dir=None)
    runner = GraphRunner(compiled, backend, config, max_batch_size=4, max_num_tokens=32)
    runner.capture()
    run_scenario(runner, model, ref_backend, twin, [("extend", 20), ("decode", 3), ("extend", 9), ("decode", 4)])
    assert runner.model_calls.count > 0 and not runner.model_calls.guards_needed
    # backend="eager" returns no GraphEntry: no direct calls, looked for once per bucket and not again
    assert runner.stats.direct_calls == 0 and set(runner.model_calls.direct.values()) == {None}
    looked = []
    record = shortcuts_module.record_graph_calls
    monkeypatch.setattr(shortcuts_module, "record_graph_calls", lambda: (looked.append(1), record())[1])
    run_scenario(runner, model, ref_backend, twin, [("decode", 3), ("decode", 4)])
    assert not looked
    assert not isinstance(runner.model_calls.guard_stance(), contextlib.nullcontext)
    assert not torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe  # restored after every step

    step = twin.decode_step(2)
    fb = step.runner_batch
    fb.input_ids = fb.input_ids.to(torch.int32)  # a dtype no compiled graph has seen: needs a recompile
    backend.init_forward_metadata(fb)
    with torch.no_grad(), forward_context(fb, backend, graph_mode="none"):
        out = runner.model_calls(fb, skip_guards=True)
    assert runner.model_calls.guards_needed and isinstance(runner.model_calls.guard_stance(), contextlib.nullcontext)
    torch.testing.assert_close(out, eager_reference(model, ref_backend, step.ref_batch), atol=1e-5, rtol=1e-5)
    assert not torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe


def test_verify_keeps_dynamo_guards() -> None:
    model = make_model()
    twin = Twin(seed=6)
    config = GraphConfig(mode="piecewise", extend_token_sizes=(16,), cache_dir=None, verify=True)
    runner = GraphRunner(torch.compile(model, backend="eager", dynamic=True),
                         CountingBackend(twin.caches[0], model.attention_layers()), config, max_batch_size=4,
                         max_num_tokens=16)
    runner.model_calls.armed, runner.model_calls.count = True, 1
    assert isinstance(runner.model_calls.guard_stance(), contextlib.nullcontext)


@NEEDS_SHORTCUTS
@pytest.mark.parametrize("direct_calls", [True, False])
def test_piecewise_steps_call_the_compiled_graph_directly_after_a_buckets_first_step(direct_calls: bool) -> None:
    """GraphConfig.direct_calls: a model compiled with backend="compile_attn" runs one graph per step and returns its
    output, so after a bucket's first step through Dynamo the runner calls that graph itself. Every step, with new
    tokens, new requests and the same buckets again, matches eager."""
    torch._dynamo.reset()
    model = make_model()
    options = {"compiler": "eager", "cache_dir": None, "extend_token_sizes": (16, 32), "decode_batch_sizes": (1, 2, 4)}
    compiled = torch.compile(model, backend="compile_attn", dynamic=True, options=options)
    twin = Twin(seed=8)
    layers = model.attention_layers()
    config = GraphConfig(mode="piecewise", decode_batch_sizes=(1, 2, 4), extend_token_sizes=(16, 32), cache_dir=None,
                         direct_calls=direct_calls)
    runner = GraphRunner(compiled, CountingBackend(twin.caches[0], layers), config, max_batch_size=4,
                         max_num_tokens=32)
    runner.capture(warm_up=False)  # the warm-up's dummy steps would be each bucket's first step
    plan = [("extend", 20), ("decode", 3), ("decode", 3), ("extend", 9), ("decode", 4), ("decode", 3),
            ("extend", 30), ("decode", 1), ("decode", 4), ("decode", 2)]
    run_scenario(runner, model, CountingBackend(twin.caches[1], layers), twin, plan)
    piecewise_steps = runner.stats.runs["piecewise"]
    if not direct_calls:
        assert runner.stats.direct_calls == 0 and not runner.model_calls.direct
        return
    # buckets 32 (extends of 20, 9 and 30 tokens: 9 pads to 16), 16, and 4, 1, 2 (decodes): the first step of each
    # after the runner's first model call goes through Dynamo, every later one directly
    first_steps = len(runner.model_calls.direct) + 1
    assert all(d is not None for d in runner.model_calls.direct.values()), runner.model_calls.direct
    # the graph's generated forward itself, not a lazily recompiled module's first-call hook
    assert {d.fn.__name__ for d in runner.model_calls.direct.values()} == {"forward"}
    assert runner.stats.direct_calls == piecewise_steps - first_steps > 0


def test_a_direct_call_needs_one_graph_call_that_returned_the_models_output() -> None:
    """DirectCall.from_record: one call of one graph, the model's result one of its outputs (as it was); repeating
    the call recomputes that output from its arguments' current contents."""
    from compile_attn.compiler.shortcuts import DirectCall, GraphEntry, record_graph_calls

    entry = GraphEntry(torch.fx.symbolic_trace(lambda x, w: (x * w, x + w)))
    x, w = torch.ones(3), torch.full((3,), 2.0)
    with record_graph_calls() as calls:
        outputs = entry(x, w)
    direct = DirectCall.from_record(calls, outputs[1])
    assert direct is not None and direct.index == 1
    x.fill_(5.0)
    assert torch.equal(direct(), torch.full((3,), 7.0))
    assert DirectCall.from_record(calls, outputs[1].clone()) is None  # not the graph's own output
    assert DirectCall.from_record(calls, outputs) is None  # a tuple: the model builds its result itself
    with record_graph_calls() as two:
        entry(x, w)
        entry(x, w)
    assert DirectCall.from_record(two, two[-1].outputs[0]) is None  # Python ran between two graphs
    assert DirectCall.from_record([], x) is None
    entry(x, w)  # outside a record: nothing noted
    assert len(two) == 2
