"""GPU: real CUDA graphs. Full decode graphs and breakable prefill graphs replay correct results across
all buckets for 200 random batches, and back-to-back batches of one bucket see no stale metadata."""

from __future__ import annotations

import random

import pytest
import torch
from tests.graph_runner.gr_helpers import CountingBackend, Twin, make_model, run_scenario

from compile_attn.config import GraphConfig
from compile_attn.graph_runner import GraphRunner
from compile_attn.models import ToyDecoderConfig

pytestmark = pytest.mark.gpu

CFG = ToyDecoderConfig(
    vocab_size=512,
    hidden_size=128,
    num_layers=3,
    num_heads=8,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=256,
)
DECODE = (1, 2, 4, 8, 16, 24, 32)
EXTEND = (16, 32, 64, 128, 256)


def _every_bucket_plan(n: int, seed: int) -> list[tuple[str, int]]:
    """``n`` batches cycling over every decode and extend bucket, sizes random inside each bucket."""
    rng = random.Random(seed)
    routes = [("decode", lo + 1, hi) for lo, hi in zip((0, *DECODE), DECODE)]
    routes += [("extend", lo + 1, hi) for lo, hi in zip((0, *EXTEND), EXTEND)]
    plan = []
    while len(plan) < n:
        rng.shuffle(routes)
        plan += [(kind, rng.randint(lo, hi)) for kind, lo, hi in routes]
    return plan[:n]


def _setup(mode: str, dtype: torch.dtype, seed: int, verify: bool = True):
    model = make_model(CFG, "cuda", dtype, seed=seed)
    twin = Twin(CFG, "cuda", dtype, seed=seed, max_batch_size=48, max_context=320, kv_cache_tokens=16384)
    layers = model.attention_layers()
    config = GraphConfig(
        mode=mode, decode_batch_sizes=DECODE, extend_token_sizes=EXTEND, cache_dir=None, verify=verify
    )
    runner = GraphRunner(
        model, CountingBackend(twin.caches[0], layers), config, max_batch_size=32, max_num_tokens=256
    )
    runner.capture()
    return model, twin, runner, CountingBackend(twin.caches[1], layers)


def test_full_decode_and_breakable_prefill_200_random_batches_fp32() -> None:
    model, twin, runner, ref = _setup("full_and_piecewise", torch.float32, seed=0)
    assert runner.stats.captures == {"full": len(DECODE), "breakable": len(EXTEND)}
    assert runner.stats.verified == len(DECODE) + len(EXTEND)
    steps = run_scenario(
        runner, model, ref, twin, _every_bucket_plan(200, seed=1), max_extend_requests=6, atol=1e-4, rtol=1e-4
    )
    assert len(steps) >= 200
    assert runner.stats.eager_fallbacks == 0
    decode_steps = sum(s.kind == "decode" for s in steps)
    assert runner.stats.runs == {"full": decode_steps, "breakable": len(steps) - decode_steps}
    assert decode_steps >= 100 and len(steps) - decode_steps >= 80
    assert twin.pools_equal()


def test_breakable_decode_and_prefill_random_batches_bf16() -> None:
    model, twin, runner, ref = _setup("breakable", torch.bfloat16, seed=2)
    assert runner.stats.segments == runner.stats.breaks + len(runner.capture_keys())
    steps = run_scenario(
        runner, model, ref, twin, _every_bucket_plan(120, seed=3), max_extend_requests=6, atol=6e-2, rtol=6e-2
    )
    assert runner.stats.runs == {"breakable": len(steps)} and len(steps) >= 120


@pytest.mark.parametrize("mode", ["full", "breakable"])
def test_second_replay_of_a_bucket_sees_the_new_batch(mode: str) -> None:
    model, twin, runner, ref = _setup(mode, torch.float32, seed=4, verify=False)
    plan = [
        ("extend", 100),
        ("decode", 20),
        ("decode", 23),
        ("decode", 17),
        ("decode", 24),
        ("decode", 5),
        ("decode", 7),
    ]
    run_scenario(runner, model, ref, twin, plan, atol=1e-4, rtol=1e-4)
    assert twin.pools_equal()
