"""The triton backend on the CPU (kernels under TRITON_INTERPRET=1), beyond the conformance suite
(tests/attention/test_conformance.py): bf16, several KV splits, distinct K and V head dims and the two-launch
decode against the float64 reference; graph-safety of the in-graph work; configuration errors."""

from __future__ import annotations

import sys

import pytest
import torch
from tests.batch_factory import random_step
from tests.reference import max_rel_error, reference_attention
from tests.attention.harness import TOL, Case, padded_decode_batch, run_case
from tests.attention.triton.tb_runner import make_runner, run_random_steps
from torch.utils._python_dispatch import TorchDispatchMode

from compile_attn import (
    AttentionLayer,
    BackendUnavailableError,
    ForwardBatch,
    ForwardMode,
    GraphMode,
    KVCache,
    UnsupportedConfigError,
    create_backend,
    forward_context,
)
from compile_attn.attention.kernel_loader import load_triton_ops
from compile_attn.attention.triton import backend as triton_backend
from compile_attn.attention.triton.backend import TritonBackend
from compile_attn.config import GraphConfig
from compile_attn.models import ToyDecoderConfig

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU interpreter tests; the GPU runs test_triton_backend_gpu.py"
)

F32, BF16 = torch.float32, torch.bfloat16
DECODE = ((5, 33, 70, 17), (1, 1, 1, 1))
EXTEND = ((0, 0, 0), (7, 20, 1))
PREFIX = ((12, 40, 3), (9, 5, 17))
MIXED = ((9, 0, 31, 16), (1, 13, 1, 6))
W = {"window": 9, "logit_cap": 30.0}

# What every backend must pass is in tests/attention/test_conformance.py (float32, head dim 64); these add bf16
# on the interpreter, several KV splits per request and a head dim other than the value head dim.
CASES = [
    pytest.param(Case(*DECODE, group=4, page_size=16), BF16, id="decode-gqa4-p16-bf16"),
    pytest.param(Case((150, 2), (1, 1), group=4, page_size=16), F32, id="decode-long-multisplit-f32"),
    pytest.param(Case(*EXTEND, group=8, page_size=1, **W), BF16, id="extend-gqa8-p1-window-cap-bf16"),
    pytest.param(Case(*PREFIX, group=8, page_size=16), BF16, id="prefix-gqa8-p16-bf16"),
    pytest.param(Case((9, 0, 31), (1, 13, 1), group=2, head_dim=96, v_head_dim=64, mode=ForwardMode.MIXED), F32,
                 id="mixed-dk96-dv64-f32"),
    pytest.param(Case(*DECODE, group=2, head_dim=96, v_head_dim=64), F32, id="decode-dk96-dv64-f32"),
    pytest.param(Case(*MIXED, group=1, page_size=1, mode=ForwardMode.MIXED, logit_cap=5.0), BF16,
                 id="mixed-gqa1-p1-cap-bf16"),
]


@pytest.mark.parametrize("case,dtype", CASES)
def test_matches_float64_reference(case: Case, dtype: torch.dtype) -> None:
    # split_size 64 makes the 150-token request run several KV splits; few splits keep the interpreter quick
    kwargs = {"split_size": 64, "max_kv_splits": 4}
    for layer_id, result in enumerate(run_case(case, "cpu", dtype, backend_kwargs=kwargs)):
        assert result.error < TOL[dtype], f"layer {layer_id}: relative error {result.error:.2e}"


@pytest.mark.parametrize("case,dtype", [CASES[0], CASES[1]])
def test_two_launch_decode_matches_float64_reference(case: Case, dtype: torch.dtype) -> None:
    # one_launch_decode=False: the splits merge in a second kernel instead of inside the split kernel
    kwargs = {"split_size": 64, "max_kv_splits": 4, "one_launch_decode": False}
    for layer_id, result in enumerate(run_case(case, "cpu", dtype, backend_kwargs=kwargs)):
        assert result.error < TOL[dtype], f"layer {layer_id}: relative error {result.error:.2e}"


def test_one_launch_decode_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = Case(*DECODE, group=4, page_size=1).make_kv("cpu", F32)
    layers = Case(*DECODE, group=4, page_size=1).layers()
    assert create_backend("triton", kv, layers).one_launch_decode
    monkeypatch.setenv("COMPILE_ATTN_DECODE_ONE_LAUNCH", "0")
    assert not create_backend("triton", kv, layers).one_launch_decode
    assert create_backend("triton", kv, layers, one_launch_decode=True).one_launch_decode


# ------------------------------------------------------------------ static graph buffers
class _RecordOps(TorchDispatchMode):
    """Records (op, output shapes) of every op; fails on host reads of tensor values."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func is not torch.ops.aten._local_scalar_dense.default, "host sync (.item()/.tolist()) in graph work"
        out = func(*args, **(kwargs or {}))
        leaves = out if isinstance(out, (tuple, list)) else [out]
        self.ops.append((str(func), tuple(tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor))))
        return out


def test_in_graph_work_is_static_shaped_and_reuses_the_static_buffers() -> None:
    """Two decode batches of one bucket with very different lengths: the recorded in-graph work (metadata and
    the attention forward) runs the same ops on the same shapes, reads nothing on the host, and writes the
    same buffers."""
    layers = [AttentionLayer(0, 8, 2, 64, sliding_window=7), AttentionLayer(1, 8, 2, 64)]
    kv = KVCache(num_layers=2, num_kv_heads=2, head_dim=64, max_batch_size=12, max_context=128, kv_cache_tokens=2048,
                 page_size=16, dtype=F32)
    backend = create_backend("triton", kv, layers, max_kv_splits=4)
    backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    gen = torch.Generator().manual_seed(0)
    records, pointers = [], []
    for lens in ([3, 100, 17], [60, 1, 2]):
        step = random_step(kv, lens, [1, 1, 1], 8, gen)
        fb = padded_decode_batch(step, 4)
        q, k, v = (torch.cat([t, t[:1]]) for t in (step.q, step.k, step.v))
        backend.init_forward_metadata_out_graph(fb)
        outs = [torch.empty_like(q) for _ in layers]
        with _RecordOps() as rec:
            backend.init_forward_metadata_in_graph(fb)
            for layer, out in zip(layers, outs):
                backend.forward(q, k, v, layer, fb, out)
        records.append(rec.ops)
        meta = backend.step_metadata
        pointers.append([t.data_ptr() for idx in meta.indexes.values()
                         for t in (idx.kv_indptr, idx.kv_indices, idx.num_kv_splits, idx.kv_start) if t is not None])
        for layer, out in zip(layers, outs):  # the windowed layer and the full one
            expected = reference_attention(q[:3], k[:3], v[:3], *kv.pool.get_kv(layer.layer_id), kv.req_to_token,
                                           step.rows, step.prefix_lens, step.extend_lens, scaling=layer.scaling,
                                           sliding_window=layer.sliding_window)
            assert max_rel_error(out[:3], expected) < TOL[F32], layer
        for row in step.rows:
            kv.free_request(row)
    assert records[0] == records[1]
    assert pointers[0] == pointers[1]
    static = backend.graph_buffers.indexes
    assert pointers[0][:4] == [static[7].kv_indptr.data_ptr(), static[7].kv_indices.data_ptr(),
                               static[7].num_kv_splits.data_ptr(), static[7].kv_start.data_ptr()]


def test_graph_view_without_static_buffers_is_a_clear_error() -> None:
    kv = KVCache(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=4, max_context=64, kv_cache_tokens=256, dtype=F32)
    backend = create_backend("triton", kv, [AttentionLayer(0, 8, 2, 64)])
    step = random_step(kv, [4], [1], 8, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_out_graph(padded_decode_batch(step, 2))
    backend.init_cuda_graph_state(max_bs=1, max_num_tokens=1)
    with pytest.raises(ValueError, match="larger max_bs"):
        backend.init_forward_metadata_out_graph(padded_decode_batch(step, 2))


# ------------------------------------------------------------------ deterministic mode
def test_deterministic_decode_is_bitwise_independent_of_the_batch() -> None:
    """One request's decode output, alone and inside batches with other requests (at other positions)."""
    kv = KVCache(num_layers=1, num_kv_heads=1, head_dim=64, max_batch_size=8, max_context=512, kv_cache_tokens=2048,
                 dtype=F32)
    layer = AttentionLayer(0, 4, 1, 64)
    step = random_step(kv, [200, 300, 301, 302, 7], [1] * 5, 4, torch.Generator().manual_seed(0))
    backend = create_backend("triton", kv, [layer], deterministic=True, split_size=64, max_kv_splits=8)
    outputs = []
    for members in ([0], [1, 0], [1, 2, 3, 0, 4]):
        sub = sub_batch(step, members)
        out = torch.empty(len(members), 4, 64)
        backend.init_forward_metadata(sub)
        with forward_context(sub, backend):
            torch.ops.compile_attn.attention(step.q[members], step.k[members], step.v[members], out, 0)
        outputs.append(out[members.index(0)])
    assert all(torch.equal(outputs[0], o) for o in outputs[1:])
    expected = reference_attention(step.q[:1], step.k[:1], step.v[:1], *kv.pool.get_kv(0), kv.req_to_token,
                                   step.rows[:1], [200], [1], scaling=layer.scaling)
    assert max_rel_error(outputs[0][None], expected) < TOL[F32]


def sub_batch(step, members: list[int]) -> ForwardBatch:
    """The decode batch of ``step``'s requests ``members`` (same rows, slots and lengths)."""
    return ForwardBatch.build(
        req_pool_indices=[step.rows[m] for m in members], prefix_lens=[step.prefix_lens[m] for m in members],
        extend_lens=[1] * len(members), out_cache_loc=step.batch.out_cache_loc[members], device="cpu",
    )


# ------------------------------------------------------------------ configuration
def _kv(**kw) -> KVCache:
    args = {"num_layers": 1, "num_kv_heads": 2, "head_dim": 64, "max_batch_size": 4, "max_context": 64, "kv_cache_tokens": 256, "dtype": F32}
    return KVCache(**(args | kw))


def test_registered_by_name_with_interpreted_kernels_it_declares_piecewise_only() -> None:
    backend = create_backend("triton", _kv(), [AttentionLayer(0, 8, 2, 64)])
    assert isinstance(backend, TritonBackend) and backend.name == "triton"
    assert TritonBackend.graph_support is GraphMode.FULL_AND_PIECEWISE
    assert backend.supported_graph_mode() is GraphMode.PIECEWISE  # no graph can record interpreted kernels
    assert "graph_support" not in vars(backend)  # declared by the class, never overwritten per instance
    assert backend.get_cuda_graph_seq_len_fill_value() == 1


@pytest.mark.parametrize("head_dim", [16, 80])
def test_unsupported_head_dim_is_rejected_with_the_supported_list(head_dim: int) -> None:
    with pytest.raises(UnsupportedConfigError, match=rf"head_dim {head_dim} .*supported: 64, .*torch_native"):
        create_backend("triton", _kv(head_dim=head_dim), [AttentionLayer(0, 8, 2, head_dim)])


def test_unsupported_dtype_is_rejected() -> None:
    with pytest.raises(UnsupportedConfigError, match=r"float64.*torch_native"):
        create_backend("triton", _kv(dtype=torch.float64), [AttentionLayer(0, 8, 2, 64)])


def test_missing_triton_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    with pytest.raises(BackendUnavailableError, match=r'pip install "compile-attn\[triton\]"'):
        create_backend("triton", _kv(), [AttentionLayer(0, 8, 2, 64)])


def test_cpu_without_the_interpreter_points_to_torch_native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_backend, "kernels_interpreted", lambda: False)
    with pytest.raises(BackendUnavailableError, match=r"torch_native.*TRITON_INTERPRET=1"):
        create_backend("triton", _kv(), [AttentionLayer(0, 8, 2, 64)])


def test_forward_without_metadata_is_a_clear_error() -> None:
    kv = _kv()
    backend = create_backend("triton", kv, [AttentionLayer(0, 8, 2, 64)])
    step = random_step(kv, [4], [1], 8, torch.Generator().manual_seed(0))
    with forward_context(step.batch, backend), pytest.raises(RuntimeError, match="init_forward_metadata"):
        torch.ops.compile_attn.attention(step.q, step.k, step.v, torch.empty_like(step.q), 0)


# ------------------------------------------------------------------ through the graph runner
def test_toy_decoder_through_graph_runner_matches_eager_torch_native() -> None:
    """On the CPU the runner downgrades decode to breakable graphs (interpreted kernels), which still run the
    padded decode views and padded extend tokens through the triton backend's three-method contract."""
    cfg = ToyDecoderConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                           intermediate_size=64, sliding_window=6)
    config = GraphConfig(mode="full_and_piecewise", decode_batch_sizes=(1, 2, 4), extend_token_sizes=(16, 32),
                         cache_dir=None)
    model, runner, twin, ref = make_runner(cfg, "cpu", F32, config, max_batch_size=4, max_num_tokens=32,
                                           max_context=40, max_kv_splits=4)
    assert runner.stats.captures == {"breakable": 5}
    report = run_random_steps(model, runner, twin, ref, [3, 1, 4, 2, 3], max_prefill=8, max_rel=1e-4,
                              max_mean_rel=1e-5)
    assert not report.failures, report.failures
    assert report.decode_steps == 5 and report.extend_steps >= 1
    assert runner.stats.runs["breakable"] == report.decode_steps + report.extend_steps


@pytest.mark.parametrize("option", [{"max_kv_splits": 0}, {"split_size": -4}])
def test_non_positive_split_options_are_rejected(option: dict) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        create_backend("triton", _kv(), [AttentionLayer(0, 8, 2, 64)], **option)


def test_default_split_count_follows_max_context_and_changes_no_output() -> None:
    """The default ``max_kv_splits`` is the most ``split_size``-token splits a request of the cache can have (3 for
    ``max_context`` 130, at most DEFAULT_MAX_KV_SPLITS): a decode batch up to that context gives the bits of a
    backend launching 16 split programs per request (3 of them with keys for the longest), and the float64
    reference's values."""
    layer = AttentionLayer(0, 8, 2, 64)
    kv = KVCache(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=4, max_context=130, kv_cache_tokens=1024,
                 page_size=4, dtype=F32)
    # deterministic: ceil(seq_len / split_size) splits per request (on the CPU the work-based count is one split)
    default = create_backend("triton", kv, [layer], deterministic=True)
    sixteen = create_backend("triton", kv, [layer], deterministic=True, max_kv_splits=16)
    assert (default.max_kv_splits, sixteen.max_kv_splits) == (3, 16)
    big = KVCache(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=1, max_context=4096, kv_cache_tokens=64)
    assert create_backend("triton", big, [layer]).max_kv_splits == load_triton_ops().DEFAULT_MAX_KV_SPLITS
    step = random_step(kv, [129, 64, 1, 100], [1, 1, 1, 1], 8, torch.Generator().manual_seed(3))
    outs = []
    for backend in (default, sixteen):
        out = torch.empty_like(step.q)
        backend.init_forward_metadata(step.batch)
        backend.forward(step.q, step.k, step.v, layer, step.batch, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    expected = reference_attention(step.q, step.k, step.v, *kv.pool.get_kv(0), kv.req_to_token, step.rows,
                                   step.prefix_lens, step.extend_lens, scaling=layer.scaling)
    assert max_rel_error(outs[0], expected) < TOL[F32]
