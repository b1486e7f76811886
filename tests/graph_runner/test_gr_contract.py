"""The three-method contract is called in the documented order at capture and at replay (counted on a
torch_native subclass that records calls; kernels are real)."""

from __future__ import annotations

from tests.graph_runner.gr_helpers import SMALL, CountingBackend, Twin, make_model

from compile_attn.config import GraphConfig
from compile_attn.graph_runner import GraphRunner

LAYERS = SMALL.num_layers


def _runner(mode: str, twin: Twin, decode=(1, 2, 4), extend=(16, 32)):
    model = make_model()
    backend = CountingBackend(twin.caches[0], model.attention_layers())
    config = GraphConfig(mode=mode, decode_batch_sizes=decode, extend_token_sizes=extend, cache_dir=None)
    return GraphRunner(model, backend, config, max_batch_size=8, max_num_tokens=64), backend


def _contract(calls: list[tuple]) -> list[tuple]:
    return [c for c in calls if c[0] != "forward"]


def _per_bucket(calls: list[tuple]) -> list[tuple[int, list[tuple]]]:
    """Split capture calls into groups that each start with out_graph(in_capture=True)."""
    groups: list[tuple[int, list[tuple]]] = []
    for c in calls:
        if c[0] == "out_graph" and c[2]:
            groups.append((c[1], []))
        groups[-1][1].append(c)
    return groups


def test_full_capture_order() -> None:
    twin = Twin()
    runner, backend = _runner("full", twin)
    runner.capture(warm_up=False)  # the calls of capture alone (the warm-up's steps follow the replay contract)
    contract = _contract(backend.calls)
    assert contract[0] == ("init_cuda_graph_state", 8, 64)
    assert sum(c[0] == "init_cuda_graph_state" for c in contract) == 1
    groups = _per_bucket(contract[1:])
    assert [b for b, _ in groups] == [4, 2, 1]  # largest first
    for bucket, calls in groups:
        # out_graph(in_capture=True) once, then in_graph before every forward: warm-up(s) + the capture
        assert calls[0] == ("out_graph", bucket, True)
        assert all(c == ("in_graph", bucket) for c in calls[1:]) and len(calls) >= 3
    forwards = [c for c in backend.calls if c[0] == "forward"]
    assert forwards and all(c[2] == "full" for c in forwards)
    assert runner.stats.captures == {"full": 3}


def test_full_replay_calls_only_out_graph() -> None:
    """At replay in_graph and attention are inside the graph: Python sees out_graph on the padded view only."""
    twin = Twin()
    runner, backend = _runner("full", twin)
    runner.capture()
    twin.step(twin.new_requests(3), [4, 2, 5])
    step = twin.decode_step(3)
    backend.calls.clear()
    runner.run(step.runner_batch)
    assert backend.calls == [("out_graph", 4, False)]
    assert runner.stats.runs["full"] == 1


def test_breakable_capture_and_replay_order() -> None:
    twin = Twin()
    runner, backend = _runner("breakable", twin)
    runner.capture(warm_up=False)
    groups = _per_bucket(_contract(backend.calls)[1:])
    assert [b for b, _ in groups] == [32, 16, 4, 2, 1]
    for bucket, calls in groups:  # in_graph runs eagerly once, outside the captured segments
        assert calls == [("out_graph", bucket, True), ("in_graph", bucket)]
    assert runner.stats.captures == {"breakable": 5}
    assert runner.stats.breaks == 5 * LAYERS and runner.stats.segments == 5 * (LAYERS + 1)

    twin.step(twin.new_requests(3), [4, 2, 5])
    step = twin.decode_step(3)
    backend.calls.clear()
    runner.run(step.runner_batch)
    # out_graph then in_graph on the padded view, then attention eagerly once per layer, between segments
    assert (
        backend.calls == [("out_graph", 4, False), ("in_graph", 4)] + [("forward", 4, "breakable")] * LAYERS
    )

    step = twin.extend_step(20, 3)
    backend.calls.clear()
    runner.run(step.runner_batch)
    assert (
        backend.calls
        == [("out_graph", 32, False), ("in_graph", 32)] + [("forward", 32, "breakable")] * LAYERS
    )


def test_eager_and_fallback_use_init_forward_metadata() -> None:
    twin = Twin()
    runner, backend = _runner("full", twin)
    runner.capture()
    step = twin.extend_step(10, 2)  # extend is eager in mode "full"
    backend.calls.clear()
    runner.run(step.runner_batch)
    assert (
        backend.calls
        == [("out_graph", None, False), ("in_graph", None)] + [("forward", None, "none")] * LAYERS
    )
    twin.step(twin.new_requests(4), [1, 2, 3, 4])
    step = twin.decode_step(6)  # larger than the largest decode bucket (4)
    backend.calls.clear()
    runner.run(step.runner_batch)
    assert _contract(backend.calls) == [("out_graph", None, False), ("in_graph", None)]
    assert runner.stats.eager_fallbacks == 1 and runner.stats.runs["none"] == 2
