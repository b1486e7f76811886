"""PiecewiseGraphWrapper on CPU with a stand-in graph that reads capture-time addresses like a CUDA graph: it captures
and replays only the buckets a graph runner's piecewise step names in the forward context."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from compile_attn.compiler import compile_counters
from compile_attn.context import forward_context
from compile_attn.compiler.cuda_graph import weak_ref_tensor
from compile_attn.compiler.piecewise import PiecewiseGraphWrapper
from compile_attn.errors import GraphReplayError


class RecordedGraph:
    """Replays ``fn`` on the tensors it was captured with and writes into the captured outputs in place."""

    def __init__(self, fn, args, outputs, counts) -> None:
        self.fn, self.args, self.outputs, self.counts = fn, args, outputs, counts

    def replay(self) -> None:
        self.counts["replays"] += 1
        for dst, src in zip(self.outputs, self.fn(*self.args), strict=True):
            dst.copy_(src)


class RecordingCapture:
    """A CPU stand-in for ``cuda_graph.capture_graph``: warm-up, "capture", one replay."""

    def __init__(self) -> None:
        self.counts = {"captures": 0, "replays": 0}

    def __call__(self, fn, args):
        self.counts["captures"] += 1
        fn(*args)  # warm-up
        graph = RecordedGraph(fn, args, fn(*args), self.counts)
        graph.replay()
        return graph, graph.outputs

    @property
    def captures(self) -> int:
        return self.counts["captures"]

    @property
    def replays(self) -> int:
        return self.counts["replays"]


FAKE_BACKEND = SimpleNamespace(layers=[], kv_cache=None)


def step(wrapper, *args, mode: str | None = "piecewise", bucket: int | None = None):
    """Call ``wrapper`` inside a graph runner's step of ``mode`` at ``bucket`` (default: the token count)."""
    bucket = args[0].shape[0] if bucket is None and mode is not None else bucket
    with forward_context(batch=None, backend=FAKE_BACKEND, graph_mode=mode, bucket=bucket):
        return wrapper(*args)


def piece(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x @ w
    return torch.relu(h), h.sum(-1)


def make_wrapper(debug: bool = False) -> tuple[PiecewiseGraphWrapper, RecordingCapture]:
    ops = RecordingCapture()
    wrapper = PiecewiseGraphWrapper(piece, "submod_0", token_count=lambda a: a[0].shape[0], debug=debug, capture=ops)
    return wrapper, ops


def test_capture_once_per_bucket_then_replay_with_new_values_at_the_same_addresses():
    wrapper, ops = make_wrapper()
    w = torch.randn(3, 5)
    buf = torch.zeros(8, 3)
    with compile_counters.expect(graphs_captured=2, graph_replays=4):
        for size in (8, 4, 8, 4, 4, 8):
            buf[:size].normal_()
            out = step(wrapper, buf[:size], w)
            expected = piece(buf[:size].clone(), w)
            for got, want in zip(out, expected, strict=True):
                torch.testing.assert_close(got, want)
    assert ops.captures == 2 and sorted(wrapper.captured) == [4, 8]


def test_steps_that_name_no_piecewise_bucket_run_without_a_graph():
    """No runner, an eager step, a full-graph step, or a piece whose token count is not the step's bucket: the
    piece runs as it is."""
    wrapper, ops = make_wrapper()
    x, w = torch.randn(5, 3), torch.randn(3, 5)
    with compile_counters.expect():
        outs = [wrapper(x, w), step(wrapper, x, w, mode="none"), step(wrapper, x, w, mode="full", bucket=5),
                step(wrapper, x, w, mode="piecewise", bucket=8)]
    for out in outs:
        torch.testing.assert_close(out[0], piece(x, w)[0])
    assert ops.captures == 0 and ops.replays == 0 and not wrapper.captured


def test_moved_input_is_refused_not_replayed_with_stale_data():
    wrapper, ops = make_wrapper()
    w = torch.randn(3, 5)
    step(wrapper, torch.randn(4, 3), w)  # capture
    fresh = torch.randn(4, 3)  # same size, another address
    with compile_counters.expect(replays_refused=1):
        out = step(wrapper, fresh, w)
    torch.testing.assert_close(out[0], piece(fresh, w)[0])
    assert ops.replays == 1  # only the replay right after the capture


def test_replay_checks_activations_and_leaves_parameters_to_debug_mode():
    """Outside debug mode a replay checks only the inputs that are not parameters (a piece's weights are most of
    its inputs); a moved activation is still refused, and debug mode names a moved parameter too."""
    for debug in (False, True):
        wrapper, ops = make_wrapper(debug=debug)
        w = torch.nn.Parameter(torch.randn(3, 5), requires_grad=False)
        x = torch.randn(4, 3)
        step(wrapper, x, w)  # capture
        assert wrapper.captured[4].inputs.checked == (0,)
        x.normal_()
        out = step(wrapper, x, w)  # same addresses: replayed with the new values
        torch.testing.assert_close(out[0], piece(x, w)[0])
        assert ops.replays == 2
        with compile_counters.expect(replays_refused=1):
            if debug:
                with pytest.raises(GraphReplayError, match="input 0"):
                    step(wrapper, torch.randn(4, 3), w)
            else:
                step(wrapper, torch.randn(4, 3), w)
        moved_w = torch.nn.Parameter(w.detach().clone(), requires_grad=False)
        if debug:
            with pytest.raises(GraphReplayError, match="input 1"):
                step(wrapper, x, moved_w)
        else:
            step(wrapper, x, moved_w)  # not checked: replayed (weights must stay where capture saw them)
            assert ops.replays == 3


def test_moved_input_is_an_error_in_debug_mode():
    wrapper, _ = make_wrapper(debug=True)
    w = torch.randn(3, 5)
    step(wrapper, torch.randn(4, 3), w)
    with pytest.raises(GraphReplayError, match=r"submod_0 at 4 tokens .* input 0"):
        step(wrapper, torch.randn(4, 3), w)


def test_passes_through_inside_a_full_graph_step():
    wrapper, ops = make_wrapper()
    step(wrapper, torch.randn(4, 3), torch.randn(3, 5), mode="full", bucket=4)
    step(wrapper, torch.randn(8, 3), torch.randn(3, 5), mode="piecewise", bucket=8)
    assert sorted(wrapper.captured) == [8] and ops.captures == 1


def test_weak_ref_aliases_without_copying():
    t = torch.arange(12.0).view(3, 4)[1:]
    ref = weak_ref_tensor(t)
    assert ref.data_ptr() == t.data_ptr() and ref.shape == t.shape and ref.stride() == t.stride()
    t.mul_(2)
    torch.testing.assert_close(ref, t)
