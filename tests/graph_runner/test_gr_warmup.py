"""Start-up warm-up (``GraphRunner.warm_up``): dummy batches reach every route a step can take (graphs with cached
prefixes and mixed batches, eager extends over the largest token bucket, eager decodes over the largest decode
bucket), touch no KV slot but the scratch slot, leave the step statistics alone; on a GPU the shapes cover every
alignment residue of the step's index tensors."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from tests.graph_runner.gr_helpers import CountingBackend, Twin, make_model

from compile_attn.config import GraphConfig
from compile_attn.graph_runner import GraphRunner
from compile_attn.graph_mode import GraphMode
from compile_attn.graph_runner.warmup import warmup_shapes
from compile_attn.batch import PAD_SLOT


def test_warm_up_reaches_every_route_and_writes_only_the_scratch_slot() -> None:
    twin = Twin()
    model = make_model()
    backend = CountingBackend(twin.caches[0], model.attention_layers())
    config = GraphConfig(mode="breakable", decode_batch_sizes=(1, 2, 4), extend_token_sizes=(16, 32), cache_dir=None)
    runner = GraphRunner(model, backend, config, max_batch_size=8, max_num_tokens=48)
    runner.capture(warm_up=False)
    pool = twin.caches[0].pool
    before = [tuple(t.clone() for t in pool.get_kv(i)) for i in range(model.cfg.num_layers)]
    stats_before = (runner.stats.runs.copy(), runner.stats.eager_fallbacks)

    seen = []  # (mode name, requests, tokens, cached prefix?, route) of every warm-up batch

    def run(fb):  # noqa: ANN001, ANN202 - the runner's own run, observed
        seen.append((fb.forward_mode.name, fb.batch_size, fb.num_tokens, sum(fb.extend_prefix_lens_cpu) > 0,
                     runner.route(fb)))
        return runner.run(fb)

    assert runner.warm_up(run) == len(seen) > 0
    graph = [s for s in seen if s[4] is not None]
    eager = [s for s in seen if s[4] is None]
    assert any(m == "MIXED" and r[0] is GraphMode.BREAKABLE for m, _, _, _, r in graph), seen
    assert any(m == "EXTEND" and prefix for m, _, _, prefix, _ in graph), seen  # a chunked prefill
    assert any(m != "DECODE" and t > 32 for m, _, t, _, _ in eager), seen  # over the largest token bucket
    assert any(m == "DECODE" and b > 4 for m, b, _, _, _ in eager), seen  # over the largest decode bucket
    assert (runner.stats.runs, runner.stats.eager_fallbacks) == stats_before
    for i, (k0, v0) in enumerate(before):
        k, v = pool.get_kv(i)
        others = torch.arange(k.shape[0]) != PAD_SLOT
        assert torch.equal(k[others], k0[others]) and torch.equal(v[others], v0[others]), f"layer {i}"


def _fake_runner(device: str, decode=(1, 2, 4, 8), extend=(16, 32, 64), max_bs=12, max_tokens=96, max_context=400):
    return SimpleNamespace(
        device=torch.device(device), buffers=SimpleNamespace(max_batch_size=max_bs, max_num_tokens=max_tokens),
        backend=SimpleNamespace(kv_cache=SimpleNamespace(max_context=max_context)),
        plan=SimpleNamespace(decode=GraphMode.FULL, extend=GraphMode.PIECEWISE),
        decode_buckets=tuple(decode), extend_buckets=tuple(extend),
    )


def test_gpu_shapes_cover_every_alignment_residue_on_each_route() -> None:
    """Triton specialises a pointer on 16-byte alignment; a step's int32/int64 index views start at offsets that
    follow the request and token counts, so every (requests, tokens) residue mod 4 must run, on graph and eager
    routes, with a cached prefix (the prefix index kernel) and without."""
    runner = _fake_runner("cuda")
    shapes = warmup_shapes(runner)
    assert len(shapes) == len(set(shapes))
    for prefix, lens in shapes:
        assert len(prefix) == len(lens) <= 12 and sum(lens) <= 96 and min(lens) >= 1
        assert all(p + n <= 400 for p, n in zip(prefix, lens))
    extends = [(len(lens), sum(lens), any(prefix)) for prefix, lens in shapes if not all(n == 1 and p for p, n in
                                                                                          zip(prefix, lens))]
    for small in (True, False):  # a bucket's graph / over the largest bucket (eager)
        for with_prefix in (True, False):
            residues = {(b % 4, t % 4) for b, t, p in extends if (t <= 64) == small and p == with_prefix}
            assert residues == {(b, t) for b in range(4) for t in range(4)}, (small, with_prefix, sorted(residues))
    assert {t for _, t, _ in extends} >= {16, 32, 64}  # every token bucket once with several requests
    mixed_rows = {len(lens) - 1 for prefix, lens in shapes
                  if len(lens) > 1 and all(n == 1 and p for p, n in zip(prefix[:-1], lens[:-1])) and lens[-1] > 1}
    assert {1, 2, 3, 4, 8, 9, 11} <= mixed_rows  # decode rows beside a prompt: every residue, each tile threshold
    decodes = sorted(len(lens) for prefix, lens in shapes if all(n == 1 and p for p, n in zip(prefix, lens)))
    assert {9, 10, 11, 12} <= set(decodes)  # eager, every residue
    assert {1, 3, 7} <= set(decodes)  # one padded batch per bucket (under its size)
    assert max(decodes) == 12


def test_cpu_shapes_are_one_per_route() -> None:
    shapes = warmup_shapes(_fake_runner("cpu"))
    assert len(shapes) <= 12, shapes  # no alignment variants where kernels are not specialised on it
    tokens = [sum(lens) for _, lens in shapes]
    assert any(t <= 64 for t in tokens) and any(t > 64 for t in tokens)
