"""The host shortcuts' one switch, ``COMPILE_ATTN_HOST_SHORTCUTS``: off, every layer takes the plain path (the
compile backend, the runner, the kernel launchers) and piecewise steps still match eager execution."""

from __future__ import annotations

import pytest
import torch
from tests.graph_runner.gr_helpers import CountingBackend, Twin, make_model, run_scenario
from torch import fx

from compile_attn.compiler import compile_counters
from compile_attn.compiler.shortcuts import record_graph_calls
from compile_attn.env import HOST_SHORTCUTS_ENV
from compile_attn.config import GraphConfig
from compile_attn.graph_runner import GraphRunner


@pytest.mark.parametrize("shortcuts", ["1", "0"])
def test_switched_off_every_layer_takes_the_plain_path_with_the_same_results(
    shortcuts: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the switch off the compile backend returns the split module itself and calls split ops through
    torch.ops, the runner keeps Dynamo's guards and frame, and new kernel launchers use ``kernel[grid]``; the
    piecewise steps still match eager execution."""
    monkeypatch.setenv(HOST_SHORTCUTS_ENV, shortcuts)
    on = shortcuts == "1"
    torch._dynamo.reset()
    model = make_model()
    compiled = torch.compile(model, backend="compile_attn", dynamic=True,
                             options={"compiler": "eager", "cache_dir": None})
    twin = Twin(seed=3)
    layers = model.attention_layers()
    config = GraphConfig(mode="piecewise", decode_batch_sizes=(1, 2, 4), extend_token_sizes=(16, 32), cache_dir=None)
    runner = GraphRunner(compiled, CountingBackend(twin.caches[0], layers), config, max_batch_size=4,
                         max_num_tokens=32)
    assert runner.model_calls.skip_guards is on and runner.model_calls.direct_calls is on
    before = compile_counters.snapshot()
    runner.capture(warm_up=False)
    with record_graph_calls() as calls:
        run_scenario(runner, model, CountingBackend(twin.caches[1], layers), twin,
                     [("extend", 20), ("decode", 3), ("decode", 3), ("decode", 3)])  # checks every step vs eager
    assert (compile_counters.delta(before).get("split_calls_direct", 0) > 0) is on
    assert (runner.stats.direct_calls > 0) is on
    assert (len(calls) > 0) is on  # only a GraphEntry notes calls
    assert all(isinstance(c.fn.__self__, fx.GraphModule) for c in calls)
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    from compile_attn.attention.kernels.launch import _SHORT_PATH, CachedLaunch

    # a compiled-kernel launcher (JITFunction itself: under TRITON_INTERPRET=1 triton.jit makes interpreted ones)
    assert CachedLaunch(JITFunction(_noop_kernel))._usable is (on and _SHORT_PATH)
    torch._dynamo.reset()


def _noop_kernel(X):  # noqa: ANN001, ANN202 - a Triton kernel body, never launched here
    pass
