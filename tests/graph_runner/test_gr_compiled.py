"""torch.compile'd models: piecewise runs the compiled model with graph_mode "piecewise" (the compile
backend's wrappers capture inside it), and full graphs capture the compiled model whole."""

from __future__ import annotations

import pytest
import torch
from gr_helpers import CountingBackend, Twin, make_model, run_scenario

from compile_attn.config import GraphConfig
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
