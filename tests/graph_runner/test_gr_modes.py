"""Every graph mode on CPU: runner outputs equal plain eager outputs for random batches of many sizes,
every live request's KV ends up identical to the eager run's, and oversize batches fall back."""

from __future__ import annotations

import random

import pytest
import torch
from tests.graph_runner.gr_helpers import CountingBackend, Twin, make_model, run_scenario

from compile_attn.config import GraphConfig
from compile_attn.graph_runner import GraphRunner

DECODE = (1, 2, 4, 8)
EXTEND = (16, 32, 64)
MODES = ["none", "full", "piecewise", "full_and_piecewise", "breakable"]


def _plan(seed: int, steps: int) -> list[tuple[str, int]]:
    """Random decode sizes 1..12 (9..12 overflow the largest bucket, 8) and extend sizes 1..80 (65.. overflow 64)."""
    rng = random.Random(seed)
    plan = []
    for _ in range(steps):
        if rng.random() < 0.5:
            plan.append(("decode", rng.choice([*range(1, 9), *range(1, 9), 9, 12])))
        else:
            plan.append(("extend", rng.choice([*range(1, 65), 70, 80])))
    return plan


def _build(mode: str, twin: Twin, model, **config):
    layers = model.attention_layers()
    runner_backend = CountingBackend(twin.caches[0], layers)
    ref_backend = CountingBackend(twin.caches[1], layers)
    config = GraphConfig(
        mode=mode, decode_batch_sizes=DECODE, extend_token_sizes=EXTEND, cache_dir=None, **config
    )
    runner = GraphRunner(model, runner_backend, config, max_batch_size=8, max_num_tokens=64)
    runner.capture()
    return runner, ref_backend


@pytest.mark.parametrize("mode", MODES)
def test_runner_matches_eager_on_random_batches(mode: str) -> None:
    model = make_model()
    twin = Twin(seed=1)
    runner, ref_backend = _build(mode, twin, model)
    plan = _plan(seed=2, steps=40)
    steps = run_scenario(runner, model, ref_backend, twin, plan)

    oversize = sum(
        1
        for s in steps
        if (s.kind == "decode" and s.runner_batch.batch_size > DECODE[-1])
        or (s.kind != "decode" and s.runner_batch.num_tokens > EXTEND[-1])
    )
    assert oversize >= 3, "the plan must exercise fallbacks"
    graph_steps = len(steps) - oversize
    if mode == "none":
        assert runner.stats.eager_fallbacks == 0
        assert runner.stats.runs["none"] == len(steps)
    elif mode == "full":  # extend runs eagerly by plan, not as a fallback
        decode_steps = [s for s in steps if s.kind == "decode"]
        over = sum(1 for s in decode_steps if s.runner_batch.batch_size > DECODE[-1])
        assert runner.stats.eager_fallbacks == over
        assert runner.stats.runs["full"] == len(decode_steps) - over
    else:
        assert runner.stats.eager_fallbacks == oversize
        assert sum(n for m, n in runner.stats.runs.items() if m != "none") == graph_steps
        assert runner.stats.runs["none"] == oversize
    assert twin.pools_equal()


@pytest.mark.parametrize("mode", ["full", "breakable"])
def test_same_bucket_back_to_back_batches_do_not_see_stale_metadata(mode: str) -> None:
    """Consecutive batches in one bucket with different rows, lengths and sizes (3 then 4 in bucket 4)."""
    model = make_model()
    twin = Twin(seed=3)
    runner, ref_backend = _build(mode, twin, model)
    plan = [("extend", 40), ("decode", 3), ("decode", 4), ("decode", 3), ("decode", 4), ("decode", 3)]
    run_scenario(runner, model, ref_backend, twin, plan)
    assert twin.pools_equal()


def test_fp32_outputs_are_tight_against_eager() -> None:
    """The bucketed graph path agrees with eager to float32 rounding (no padding leaks into real rows)."""
    model = make_model()
    twin = Twin(seed=4)
    runner, ref_backend = _build("full_and_piecewise", twin, model)
    run_scenario(
        runner, model, ref_backend, twin, [("decode", 5), ("extend", 17), ("decode", 7)], atol=1e-6, rtol=1e-6
    )


def test_run_before_capture_is_a_clear_error() -> None:
    model = make_model()
    twin = Twin()
    runner = GraphRunner(
        model,
        CountingBackend(twin.caches[0], model.attention_layers()),
        GraphConfig(mode="full", decode_batch_sizes=DECODE, cache_dir=None),
        max_batch_size=8,
        max_num_tokens=64,
    )
    rows = twin.new_requests(2)
    twin.step(rows, [3, 4])
    step = twin.decode_step(2)
    with pytest.raises(RuntimeError, match="capture"):
        runner.run(step.runner_batch)


def test_verify_runs_every_bucket_and_leaves_the_cache_empty() -> None:
    model = make_model()
    twin = Twin()
    runner, _ = _build("full_and_piecewise", twin, model, verify=True)
    assert runner.stats.verified == len(runner.routes()) == len(DECODE) + len(EXTEND)
    assert twin.caches[0].req_to_token_pool.available == twin.caches[0].req_to_token_pool.max_batch_size
    assert sum(runner.stats.runs.values()) == 0  # verify does not count as steps


def test_bf16_model_through_full_and_breakable() -> None:
    model = make_model(dtype=torch.bfloat16)
    twin = Twin(seed=5, dtype=torch.bfloat16)
    runner, ref_backend = _build("full_and_piecewise", twin, model)
    run_scenario(runner, model, ref_backend, twin, _plan(seed=6, steps=12), atol=2e-2, rtol=2e-2)


def test_verify_keeps_one_token_extends_on_the_extend_route() -> None:
    """A 1-token extend onto a cached prefix looks like decode to ForwardBatch.build; verify must not mis-route it."""
    from compile_attn.graph_runner import verify_runner

    model = make_model()
    twin = Twin()
    config = GraphConfig(
        mode="full_and_piecewise", decode_batch_sizes=(1, 2), extend_token_sizes=(1, 2), cache_dir=None
    )
    runner = GraphRunner(
        model,
        CountingBackend(twin.caches[0], model.attention_layers()),
        config,
        max_batch_size=2,
        max_num_tokens=2,
    )
    runner.capture()
    for seed in range(12):
        assert verify_runner(runner, seed=seed) == 4
