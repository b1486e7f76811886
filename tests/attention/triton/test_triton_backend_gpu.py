"""GPU tests of the triton backend (compiled kernels, bf16): hypothesis batches with sequences up to 8k tokens
against a float64 reference; decode captured as CUDA graphs per bucket and replayed with new (padded) batches;
a ToyDecoder through the GraphRunner against eager torch_native; bitwise batch-invariance of deterministic mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest
import torch
from tests.batch_factory import random_step
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.reference import max_rel_error
from tests.attention.harness import TOL, Case, chunked_reference, decode_replays, run_case
from tests.attention.triton.tb_runner import make_runner, run_random_steps

from compile_attn import AttentionLayer, ForwardBatch, ForwardMode, KVCache, create_backend, forward_context
from compile_attn.env import host_shortcuts_enabled
from compile_attn.config import GraphConfig
from compile_attn.models import ToyDecoderConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF16, F32 = torch.bfloat16, torch.float32
MAX_LEN = 8192


@contextlib.contextmanager
def exact_fp32_matmuls() -> Iterator[None]:
    """fp32 references and torch_native einsums without TF32, whatever earlier tests set."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


# ------------------------------------------------------------------ against the float64 reference
@st.composite
def gpu_cases(draw: st.DrawFn) -> Case:
    kind = draw(st.sampled_from(["decode", "extend", "prefix", "mixed"]))
    bs = draw(st.integers(1, 8 if kind == "decode" else 4))
    long = st.integers(1, MAX_LEN)
    if kind == "decode":
        prefix, extend = draw(st.lists(long, min_size=bs, max_size=bs)), [1] * bs
    elif kind == "extend":
        prefix, extend = [0] * bs, draw(st.lists(st.integers(1, 2048), min_size=bs, max_size=bs))
    elif kind == "prefix":
        prefix = draw(st.lists(st.integers(0, MAX_LEN), min_size=bs, max_size=bs))
        extend = draw(st.lists(st.integers(1, 1024), min_size=bs, max_size=bs))
    else:  # one decode-like request plus prefills, some with a cached prefix
        prefix = [draw(long)] + draw(st.lists(st.integers(0, 4096), min_size=bs, max_size=bs))
        extend = [1] + draw(st.lists(st.integers(1, 512), min_size=bs, max_size=bs))
    group = draw(st.sampled_from([1, 4, 8]))
    return Case(
        tuple(prefix), tuple(extend), num_kv_heads=draw(st.sampled_from([1, 2])), group=group,
        page_size=draw(st.sampled_from([1, 16])), window=draw(st.sampled_from([None, 64, 1000])),
        logit_cap=draw(st.sampled_from([0.0, 30.0])), head_dim=draw(st.sampled_from([64, 128])),
        mode=ForwardMode.MIXED if kind == "mixed" else None,
    )


@settings(max_examples=25, deadline=None)
@given(gpu_cases(), st.integers(0, 2**16))
def test_matches_float64_reference_bf16(case: Case, seed: int) -> None:
    for layer_id, result in enumerate(run_case(case, "cuda", BF16, seed=seed, reference=chunked_reference)):
        assert result.error < TOL[BF16], f"layer {layer_id}: relative error {result.error:.2e} for {case}"


LONG = [
    Case((1, 8192, 3000, 4097, 129), (1, 1, 1, 1, 1), group=8, page_size=16),
    Case((8192, 517, 1), (1, 1, 1), num_kv_heads=2, group=4, page_size=1, window=1000, logit_cap=30.0),
    Case((0, 3000, 8000), (2048, 1, 192), group=4, page_size=16),
    Case((0, 2048, 5000), (1024, 300, 1), num_kv_heads=1, group=1, page_size=1, window=700,
         mode=ForwardMode.MIXED),
]


@pytest.mark.parametrize("dims", [(64, None), (128, None), (256, None), (192, 128)], ids=lambda d: f"d{d[0]}-dv{d[1]}")
@pytest.mark.parametrize("case", LONG, ids=["decode", "decode-window-cap", "prefix", "mixed-window"])
def test_long_sequences_bf16(case: Case, dims: tuple[int, int | None]) -> None:
    case = dataclasses.replace(case, head_dim=dims[0], v_head_dim=dims[1])
    for layer_id, result in enumerate(run_case(case, "cuda", BF16, reference=chunked_reference)):
        assert result.error < TOL[BF16], f"layer {layer_id}: relative error {result.error:.2e}"


def test_fp32_matches_reference_tightly() -> None:
    with exact_fp32_matmuls():
        for case in (Case((40, 900, 7), (1, 1, 1), group=4, page_size=16, window=64, logit_cap=30.0),
                     Case((0, 700, 33), (300, 17, 1), group=8, page_size=1, window=64, mode=ForwardMode.MIXED)):
            for result in run_case(case, "cuda", F32, reference=chunked_reference):
                assert result.error < TOL[F32]


@pytest.mark.parametrize("mixed", [False, True])
def test_padding_tokens_of_a_piecewise_bucket_get_zero_output(mixed: bool) -> None:
    case = Case((9, 0, 310, 16), (1, 130, 1, 6), mode=ForwardMode.MIXED) if mixed else Case((120, 40, 3), (90, 5, 17))
    for result in run_case(dataclasses.replace(case, window=64, logit_cap=30.0), "cuda", BF16, pad_tokens=13,
                           reference=chunked_reference):
        assert result.error < TOL[BF16]
        assert torch.count_nonzero(result.pad_out) == 0


# ------------------------------------------------------------------ CUDA graphs
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_cuda_graphs_replay_new_batches_per_bucket(page_size: int, deterministic: bool) -> None:
    """One capture per bucket (1, 4, 16) of in-graph metadata + two layers (window+softcap, full), then ten new
    batches per bucket (every other one padded with PAD_REQUEST requests), out_graph before each replay."""
    report = decode_replays("cuda", BF16, buckets=(1, 4, 16), trials=10, capture=True, max_len=3000,
                            page_size=page_size, head_dim=128, reference=chunked_reference,
                            backend_kwargs={"deterministic": deterministic})
    assert report.trials == 30 and len(report.errors) == 60
    assert max(report.errors) < TOL[BF16], report.errors


def test_graph_bound_decode_without_a_graph_relaunches_bound_with_each_steps_data() -> None:
    """What a decode layer between piecewise graphs sees: the same static tensors every step, run eagerly. From the
    second step of a bucket on, every layer launches through its DecodePlan, reading that step's metadata and
    inputs (ten new batches per bucket, every other one padded)."""
    report = decode_replays("cuda", BF16, buckets=(1, 4, 16), trials=10, capture=False, max_len=3000,
                            page_size=16, head_dim=64, reference=chunked_reference)
    assert report.trials == 30 and max(report.errors) < TOL[BF16], report.errors
    # two layers, every trial after the warm-up call that bound them (a host shortcut: none while switched off)
    assert report.bound_launches == (2 * 30 if host_shortcuts_enabled() else 0)


@pytest.mark.parametrize(
    "mode,dtype,window",
    [("full", BF16, None), ("full", F32, 24), ("full_and_piecewise", BF16, 24)],
    ids=["full-bf16", "full-fp32-window", "full-and-piecewise-bf16-window"],
)
def test_toy_decoder_through_graph_runner_matches_eager_torch_native(mode: str, dtype: torch.dtype,
                                                                      window: int | None) -> None:
    """Full decode graphs for buckets 1/2/4/8 with triton attention; every step (random decode sizes, prefills
    in between) against the same step run eagerly with torch_native on a twin KV cache."""
    cfg = ToyDecoderConfig(vocab_size=512, hidden_size=256, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64,
                           intermediate_size=512, sliding_window=window)
    config = GraphConfig(mode=mode, decode_batch_sizes=(1, 2, 4, 8), extend_token_sizes=(16, 32, 64), cache_dir=None)
    with exact_fp32_matmuls():
        model, runner, twin, ref = make_runner(cfg, "cuda", dtype, config, max_batch_size=8, max_num_tokens=64,
                                               max_context=128)
        assert runner.stats.captures["full"] == 4
        gen = torch.Generator().manual_seed(1)
        sizes = torch.randint(1, 9, (40,), generator=gen).tolist()
        tol = {"max_rel": 4e-2, "max_mean_rel": 1.5e-2} if dtype == BF16 else {"max_rel": 5e-4, "max_mean_rel": 5e-5}
        report = run_random_steps(model, runner, twin, ref, sizes, max_prefill=24, **tol)
    assert not report.failures, (report.failures, report)
    assert report.decode_steps == 40 and runner.stats.runs["full"] == 40
    assert runner.stats.eager_fallbacks == 0 or mode == "full_and_piecewise"  # big prefills fall back there


# ------------------------------------------------------------------ deterministic mode
def test_deterministic_decode_is_bitwise_independent_of_the_batch() -> None:
    """A 5000-token request's decode output alone, and at different positions in batches of 4 and 32 requests
    whose lengths would make the default heuristic choose other split counts for it."""
    kv = KVCache(num_layers=1, num_kv_heads=2, head_dim=128, max_batch_size=40, max_context=8192, kv_cache_tokens=40 * 8192,
                 page_size=16, dtype=BF16, device="cuda")
    layer = AttentionLayer(0, 16, 2, 128)
    gen = torch.Generator().manual_seed(0)
    lens = [5000] + torch.randint(1, 8000, (31,), generator=gen).tolist()
    step = random_step(kv, lens, [1] * 32, 16, gen)
    outputs = {}
    for deterministic in (True, False):
        backend = create_backend("triton", kv, [layer], deterministic=deterministic)
        outputs[deterministic] = []
        for members in ([0], [3, 0, 1, 2], [*range(31, 0, -1), 0], [5, 0, *range(6, 32), 1, 2, 3, 4]):
            fb = ForwardBatch.build(
                req_pool_indices=[step.rows[m] for m in members], prefix_lens=[lens[m] for m in members],
                extend_lens=[1] * len(members), out_cache_loc=step.batch.out_cache_loc[members], device="cuda",
            )
            out = torch.empty(len(members), 16, 128, dtype=BF16, device="cuda")
            backend.init_forward_metadata(fb)
            with forward_context(fb, backend):
                torch.ops.compile_attn.attention(step.q[members], step.k[members], step.v[members], out, 0)
            outputs[deterministic].append(out[members.index(0)].clone())
    first = outputs[True][0]
    assert all(torch.equal(first, o) for o in outputs[True][1:])
    expected = chunked_reference(step.q[:1], step.k[:1], step.v[:1], *kv.pool.get_kv(0), kv.req_to_token,
                                 step.rows[:1], [5000], [1], scaling=layer.scaling)
    assert max_rel_error(first[None], expected) < TOL[BF16]
    assert all(max_rel_error(o[None], expected) < TOL[BF16] for o in outputs[False])
