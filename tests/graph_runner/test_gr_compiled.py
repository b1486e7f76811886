"""torch.compile'd models: piecewise runs the compiled model with graph_mode "piecewise" (the compile
backend's wrappers capture inside it), and full graphs capture the compiled model whole."""

from __future__ import annotations

import contextlib

import pytest
import torch
from gr_helpers import CountingBackend, Twin, eager_reference, make_model, run_scenario

from compile_attn.config import GraphConfig
from compile_attn.context import forward_context
from compile_attn.graph_runner import ExecMode, GraphRunner


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_compiled_model_matches_eager(mode: str) -> None:
    model = make_model()
    compiled = torch.compile(model, backend="eager", dynamic=True)
    twin = Twin(seed=21)
    layers = model.attention_layers()
    backend = CountingBackend(twin.caches[0], layers)
    config = GraphConfig(
        mode=mode, decode_batch_sizes=(1, 2, 4), prefill_token_sizes=(16, 32), cache_dir=None
    )
    runner = GraphRunner(compiled, backend, config, max_batch_size=4, max_num_tokens=32)
    assert runner.plan.extend is ExecMode.PIECEWISE
    runner.capture()
    piecewise_buckets = {b for m, b in runner.capture_keys() if m is ExecMode.PIECEWISE}
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


def test_piecewise_steps_skip_dynamo_guards_and_fall_back_to_guards_on_a_recompile() -> None:
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
    config = GraphConfig(mode="piecewise", decode_batch_sizes=(1, 2, 4), prefill_token_sizes=(16, 32), cache_dir=None)
    runner = GraphRunner(compiled, backend, config, max_batch_size=4, max_num_tokens=32)
    runner.capture()
    run_scenario(runner, model, ref_backend, twin, [("extend", 20), ("decode", 3), ("extend", 9), ("decode", 4)])
    assert runner._model_calls > 0 and not runner._guards_needed
    assert not isinstance(runner._guard_stance(), contextlib.nullcontext)
    assert not torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe  # restored after every step

    step = twin.decode_step(2)
    fb = step.runner_batch
    fb.input_ids = fb.input_ids.to(torch.int32)  # a dtype no compiled graph has seen: needs a recompile
    backend.init_forward_metadata(fb)
    with torch.no_grad(), forward_context(fb, backend, graph_mode="none"):
        out = runner._call_model(fb, skip_guards=True)
    assert runner._guards_needed and isinstance(runner._guard_stance(), contextlib.nullcontext)
    torch.testing.assert_close(out, eager_reference(model, ref_backend, step.ref_batch), atol=1e-5, rtol=1e-5)
    assert not torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe


def test_verify_keeps_dynamo_guards() -> None:
    model = make_model()
    twin = Twin(seed=6)
    config = GraphConfig(mode="piecewise", prefill_token_sizes=(16,), cache_dir=None, verify=True)
    runner = GraphRunner(torch.compile(model, backend="eager", dynamic=True),
                         CountingBackend(twin.caches[0], model.attention_layers()), config, max_batch_size=4,
                         max_num_tokens=16)
    runner.captured, runner._model_calls = True, 1
    assert isinstance(runner._guard_stance(), contextlib.nullcontext)
