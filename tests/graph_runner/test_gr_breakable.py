"""Breakable capture on its own: segments cut at split ops, user split ops that return tensors, work a
graph cannot replay (host syncs, data-dependent shapes), and verify catching a backend that breaks the
static-buffer contract."""

from __future__ import annotations

import pytest
import torch
from tests.graph_runner.gr_helpers import Twin, make_model

from compile_attn import register_split_op
from compile_attn.attention.torch_native.backend import TorchNativeBackend, _DecodeMetadata
from compile_attn.config import GraphConfig
from compile_attn.graph_runner import GraphCaptureError, GraphRunner, GraphVerificationError, capture_segments
from compile_attn.ops import unregister_split_op

CPU = torch.device("cpu")
_LIVE_SCALE = [2.0]  # read by the test op at call time, like attention reads the forward context


@torch.library.custom_op("gr_test::live_scale", mutates_args=())
def live_scale(x: torch.Tensor) -> torch.Tensor:
    return x * _LIVE_SCALE[0]


@live_scale.register_fake
def _(x):
    return torch.empty_like(x)


def test_user_split_op_returning_a_tensor_runs_eagerly_between_segments() -> None:
    x = torch.randn(5)
    register_split_op("gr_test::live_scale")
    try:
        graph = capture_segments(lambda: torch.ops.gr_test.live_scale(x * 3) + 1, device=CPU)
    finally:
        unregister_split_op("gr_test::live_scale")
    assert (graph.num_segments, graph.num_breaks) == (2, 1)
    torch.testing.assert_close(graph.output, x * 3 * 2.0 + 1)
    x.copy_(torch.randn(5))  # new input in the static tensor, new live state for the op
    _LIVE_SCALE[0] = -0.5
    try:
        out = graph.replay()
    finally:
        _LIVE_SCALE[0] = 2.0
    torch.testing.assert_close(out, x * 3 * -0.5 + 1)


def test_without_registration_the_op_is_baked_into_the_segment() -> None:
    """Control for the test above: an op that is not a split op is replayed, not re-read live."""
    x = torch.ones(3)
    graph = capture_segments(lambda: torch.ops.gr_test.live_scale(x) + 1, device=CPU)
    assert (graph.num_segments, graph.num_breaks) == (1, 0)


def test_host_sync_inside_a_segment_is_refused() -> None:
    x = torch.randn(4)
    with pytest.raises(GraphCaptureError, match="host"):
        capture_segments(lambda: x * float(x.sum()), device=CPU)


def test_data_dependent_shape_is_refused_at_replay() -> None:
    x = torch.tensor([1.0, -1.0, 2.0])
    graph = capture_segments(lambda: x[x > 0] * 2, device=CPU)
    x.copy_(torch.tensor([1.0, 1.0, 1.0]))
    with pytest.raises(GraphCaptureError, match="data-dependent"):
        graph.replay()


def test_toy_decoder_breaks_once_per_attention_layer() -> None:
    model = make_model()
    twin = Twin()
    config = GraphConfig(mode="breakable", decode_batch_sizes=(2,), extend_token_sizes=(16,), cache_dir=None)
    runner = GraphRunner(
        model,
        TorchNativeBackend(twin.caches[0], model.attention_layers()),
        config,
        max_batch_size=4,
        max_num_tokens=16,
    )
    runner.capture()
    layers = len(model.attention_layers())
    for graph in runner._graphs.values():
        assert (graph.num_segments, graph.num_breaks) == (layers + 1, layers)


class FreshSeqLensBackend(TorchNativeBackend):
    """Breaks the contract: at replay the decode seq_lens live in a new tensor instead of the static buffer."""

    def init_forward_metadata_out_graph(self, fb, in_capture=False) -> None:
        super().init_forward_metadata_out_graph(fb, in_capture)
        if fb.forward_mode.is_decode() and fb.graph_bucket is not None:
            self._decode = _DecodeMetadata(self._decode.table, fb.seq_lens.clone())


def test_verify_fails_loudly_naming_bucket_and_mode() -> None:
    model = make_model()
    twin = Twin()
    config = GraphConfig(mode="full", decode_batch_sizes=(4,), cache_dir=None, verify=True)
    runner = GraphRunner(
        model,
        FreshSeqLensBackend(twin.caches[0], model.attention_layers()),
        config,
        max_batch_size=4,
        max_num_tokens=16,
    )
    with pytest.raises(GraphVerificationError, match=r"graph mode 'full', decode bucket 4"):
        runner.capture()
