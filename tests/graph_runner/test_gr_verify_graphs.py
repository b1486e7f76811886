"""Full verify graphs (``GraphConfig.verify_tokens``): chain verify batches whose requests verify Q tokens (or fewer,
in the last rows of their Q) replay a graph of their own, keyed by requests and padded like decode views, where the
backend has a verify mode; other verify batches replay the decode graphs as decode rows (``verify_unroll.py``). On the CPU the triton backend's
kernels are interpreted (no full graphs), so a torch_native test double with a graph-recordable verify mode stands in
for it; the outputs are checked against plain eager steps on a twin cache, and the routes through the runner's
counters. With ``verify_trees`` the verify graphs take draft trees of Q tokens per request too, their ancestor masks
written out of graph (the double's static buffer; the triton backend's on a GPU)."""

from __future__ import annotations

import pytest
import torch
from tests.graph_runner.gr_helpers import CountingBackend, Twin, VerifyModeNative, eager_reference, make_model

from compile_attn import ForwardMode, create_backend
from compile_attn.config import GraphConfig
from compile_attn.graph_runner import GraphRunner
from compile_attn.models import ToyDecoderConfig


Q = 3  # tokens per request of the verify graphs
DECODE = (1, 2, 4, 8)  # rows: up to 4 requests x Q, as the engine sizes them (decode_graph_rows)
BUCKETS = (1, 2, 4)  # the verify graphs: the decode buckets whose requests' tokens fit


def _runner(backend_cls: type, twin: Twin, model) -> GraphRunner:  # noqa: ANN001
    backend = backend_cls(twin.caches[0], model.attention_layers())
    runner = GraphRunner(model, backend, GraphConfig(mode="full", decode_batch_sizes=DECODE, cache_dir=None,
                                                     verify_tokens=Q), max_batch_size=4 * Q, max_num_tokens=32)
    runner.capture()
    return runner


def _prefill(twin: Twin, runner: GraphRunner, model, ref_backend, n: int) -> list[int]:  # noqa: ANN001
    ids = twin.new_requests(n)
    step = twin.step(ids, [5 + 3 * i for i in range(n)])
    torch.testing.assert_close(runner.run(step.runner_batch), eager_reference(model, ref_backend, step.ref_batch))
    return ids


def test_uniform_chain_verify_steps_replay_verify_graphs_padded_like_decode() -> None:
    model, twin = make_model(), Twin(seed=5)
    runner = _runner(VerifyModeNative, twin, model)
    assert runner.verify_buckets == BUCKETS
    assert runner.stats.verify_graphs == len(BUCKETS) and runner.stats.captures["full"] == len(DECODE) + len(BUCKETS)
    ref_backend = CountingBackend(twin.caches[1], model.attention_layers())
    ids = _prefill(twin, runner, model, ref_backend, 3)
    for _ in range(2):  # 3 requests in the 4-request graph (one padded request), twice: stale buffers would show
        step = twin.step(ids, [Q] * 3, ForwardMode.TARGET_VERIFY)
        assert runner.verify_route(step.runner_batch) == 4
        out = runner.run(step.runner_batch)
        assert out.shape[0] == 3 * Q
        torch.testing.assert_close(out, eager_reference(model, ref_backend, step.ref_batch), atol=1e-5, rtol=1e-5)
    assert runner.stats.verify_runs == 2 and runner.backend.verify_forwards > 0
    decode = twin.step(ids[:2], [1, 1])  # a decode view after verify views: the request padding is restored
    torch.testing.assert_close(runner.run(decode.runner_batch), eager_reference(model, ref_backend, decode.ref_batch),
                               atol=1e-5, rtol=1e-5)
    assert runner.stats.runs["full"] == 3 and runner.stats.verify_runs == 2


@pytest.mark.parametrize("lens", [[Q, Q - 1, 1], [1, 1, Q - 1], [Q - 1, Q - 1, Q - 1]],
                         ids=["full-fewer-none", "nones-first", "all-fewer"])
def test_fewer_drafts_take_the_last_rows_of_the_verify_graph(lens: list[int]) -> None:
    """Requests verifying fewer than Q tokens (prompt lookup's mixed draft counts) replay the verify graph, their
    tokens in the last rows of their Q (verify_layout.py): the outputs equal plain eager steps', in the batch's order,
    twice over (stale filler rows would show), then a uniform step after them."""
    model, twin = make_model(), Twin(seed=8)
    runner = _runner(VerifyModeNative, twin, model)
    ref_backend = CountingBackend(twin.caches[1], model.attention_layers())
    ids = _prefill(twin, runner, model, ref_backend, 3)
    for step_lens in (lens, list(reversed(lens)), [Q] * 3):
        step = twin.step(ids, step_lens, ForwardMode.TARGET_VERIFY)
        assert runner.verify_route(step.runner_batch) == 4
        out = runner.run(step.runner_batch)
        assert out.shape[0] == sum(step_lens)
        torch.testing.assert_close(out, eager_reference(model, ref_backend, step.ref_batch), atol=1e-5, rtol=1e-5)
    assert runner.stats.verify_runs == 3 and runner.stats.runs["full"] == 3


def test_a_prefix_shorter_than_its_filler_rows_takes_the_decode_rows() -> None:
    """A request whose prefix is shorter than its filler rows (one would see no key) keeps the decode-row route."""
    model, twin = make_model(), Twin(seed=9)
    runner = _runner(VerifyModeNative, twin, model)
    ref_backend = CountingBackend(twin.caches[1], model.attention_layers())
    ids = twin.new_requests(2)
    prefill = twin.step(ids, [1, 6])  # request 0 holds one token: 1 < Q - 1 filler rows
    torch.testing.assert_close(runner.run(prefill.runner_batch), eager_reference(model, ref_backend, prefill.ref_batch))
    step = twin.step(ids, [1, Q], ForwardMode.TARGET_VERIFY)
    assert runner.verify_route(step.runner_batch) is None
    torch.testing.assert_close(runner.run(step.runner_batch), eager_reference(model, ref_backend, step.ref_batch),
                               atol=1e-5, rtol=1e-5)
    assert runner.stats.verify_runs == 0


@pytest.mark.parametrize("backend_cls, lens", [
    pytest.param(VerifyModeNative, [Q + 1, Q + 1], id="another-Q"),
    pytest.param(CountingBackend, [Q, Q], id="backend-without-verify-mode"),
])
def test_other_chain_verify_steps_replay_decode_graphs_as_rows(backend_cls: type, lens: list[int]) -> None:
    model, twin = make_model(), Twin(seed=6)
    runner = _runner(backend_cls, twin, model)
    assert runner.stats.verify_graphs == (len(BUCKETS) if backend_cls is VerifyModeNative else 0)
    ref_backend = CountingBackend(twin.caches[1], model.attention_layers())
    ids = _prefill(twin, runner, model, ref_backend, 2)
    step = twin.step(ids, lens, ForwardMode.TARGET_VERIFY)
    assert runner.verify_route(step.runner_batch) is None
    out = runner.run(step.runner_batch)
    torch.testing.assert_close(out, eager_reference(model, ref_backend, step.ref_batch), atol=1e-5, rtol=1e-5)
    assert runner.stats.runs["full"] == 1 and runner.stats.verify_runs == 0  # the decode graph of its token count


def _tree_runner(twin: Twin, model, trees: bool = True) -> GraphRunner:  # noqa: ANN001
    backend = VerifyModeNative(twin.caches[0], model.attention_layers())
    runner = GraphRunner(model, backend, GraphConfig(mode="full", decode_batch_sizes=DECODE, cache_dir=None,
                                                     verify_tokens=Q, verify_trees=trees),
                         max_batch_size=4 * Q, max_num_tokens=32)
    runner.capture()
    return runner


TREES = ((-1, 0, 0), (-1, 0, 1), (-1, 0, 0))  # Q = 3 tokens each: two trees and a chain


def test_tree_verify_steps_replay_the_tree_verify_graphs() -> None:
    """``verify_trees``: draft trees of Q tokens per request replay the verify graph of their request bucket, the
    ancestor masks written out of graph; the outputs equal plain eager steps (the extend path's tree masks), twice
    (stale masks would show), then chain steps (Q and fewer tokens) through the same tree graphs."""
    model, twin = make_model(), Twin(seed=11)
    runner = _tree_runner(twin, model)
    assert runner.verify_buckets == BUCKETS and runner.stats.verify_graphs == len(BUCKETS)
    ref_backend = CountingBackend(twin.caches[1], model.attention_layers())
    ids = _prefill(twin, runner, model, ref_backend, 3)
    for trees in (TREES, tuple(reversed(TREES))):
        step = twin.step(ids, [Q] * 3, ForwardMode.TARGET_VERIFY, draft_parents=trees)
        assert runner.verify_route(step.runner_batch) == 4
        out = runner.run(step.runner_batch)
        ref = eager_reference(model, ref_backend, step.ref_batch)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert runner.backend.tree_forwards > 0 and runner.stats.verify_runs == 2
    chains = twin.step(ids, [Q] * 3, ForwardMode.TARGET_VERIFY)
    assert not torch.allclose(eager_reference(model, CountingBackend(twin.caches[1], model.attention_layers()),
                                              chains.ref_batch)[:Q], ref[:Q], atol=1e-3)  # the trees mattered
    for step in (chains, twin.step(ids, [Q, 1, Q - 1], ForwardMode.TARGET_VERIFY)):
        if step is not chains:
            assert runner.verify_route(step.runner_batch) == 4  # fewer tokens: end-aligned, as chains of Q
        torch.testing.assert_close(runner.run(step.runner_batch),
                                   eager_reference(model, ref_backend, step.ref_batch), atol=1e-5, rtol=1e-5)
    assert runner.stats.verify_runs == 4 and runner.stats.runs["full"] == 4


def test_other_tree_steps_keep_their_route() -> None:
    """Trees of other token counts take the extend route (eager here: a full-only runner), and a runner whose verify
    graphs are for chains sends every tree there."""
    model, twin = make_model(), Twin(seed=12)
    tree_runner, chain_runner = _tree_runner(twin, model), _tree_runner(twin, model, trees=False)
    ref_backend = CountingBackend(twin.caches[1], model.attention_layers())
    ids = _prefill(twin, tree_runner, model, ref_backend, 2)
    step = twin.step(ids, [4, 2], ForwardMode.TARGET_VERIFY, draft_parents=((-1, 0, 0, 1), (-1, 0)))
    assert tree_runner.verify_route(step.runner_batch) is None
    torch.testing.assert_close(tree_runner.run(step.runner_batch), eager_reference(model, ref_backend, step.ref_batch),
                               atol=1e-5, rtol=1e-5)
    assert tree_runner.stats.verify_runs == 0
    uniform = twin.step(ids, [Q, Q], ForwardMode.TARGET_VERIFY, draft_parents=TREES[:2])
    assert chain_runner.verify_route(uniform.runner_batch) is None
    assert tree_runner.verify_route(uniform.runner_batch) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tree_verify_graphs_of_the_triton_backend_on_a_gpu() -> None:
    """The triton backend on a GPU: tree verify steps replay its captured tree verify graphs (the kernel's tree mask
    read from the static buffer), with other trees on the second step, and equal plain eager torch_native steps on a
    twin cache; then a chain step through the same graphs."""
    cfg = ToyDecoderConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                           intermediate_size=64)
    model, twin = make_model(cfg, device="cuda"), Twin(cfg, device="cuda", seed=13)
    backend = create_backend("triton", twin.caches[0], model.attention_layers())
    runner = GraphRunner(model, backend, GraphConfig(mode="full", decode_batch_sizes=DECODE, cache_dir=None,
                                                     verify_tokens=Q, verify_trees=True),
                         max_batch_size=4 * Q, max_num_tokens=32)
    runner.capture()
    assert runner.verify_buckets == BUCKETS and runner.stats.verify_graphs == len(BUCKETS)
    ref_backend = CountingBackend(twin.caches[1], model.attention_layers())
    ids = twin.new_requests(3)
    prefill = twin.step(ids, [5, 8, 11])
    torch.testing.assert_close(runner.run(prefill.runner_batch),
                               eager_reference(model, ref_backend, prefill.ref_batch), atol=1e-4, rtol=1e-4)
    for trees in (TREES, tuple(reversed(TREES)), None):
        step = twin.step(ids, [Q] * 3, ForwardMode.TARGET_VERIFY, draft_parents=trees)
        assert runner.verify_route(step.runner_batch) == 4
        torch.testing.assert_close(runner.run(step.runner_batch), eager_reference(model, ref_backend, step.ref_batch),
                                   atol=1e-4, rtol=1e-4)
    assert runner.stats.verify_runs == 3 and backend.verify.tree_steps >= 3
