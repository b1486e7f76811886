"""The triton backend's verify mode (``attention/triton/verify_mode.py``): chain verify batches whose requests all
verify Q tokens run in the decode kernel's ``tokens_per_request`` mode, eagerly and as a graph runner's padded verify
view, against the float64 reference of tests/attention/verify_harness.py; other verify batches keep the extend path.
Draft trees of one length Q take the same mode with a per-row ancestor mask. CPU only, kernels under TRITON_INTERPRET
(small cases: the interpreter is slow)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.attention.harness import TOL
from tests.attention.verify_harness import VerifyCase, run_verify

from compile_attn import KVCache, create_backend
from compile_attn.attention.kernels.decode_checks import MAX_VERIFY_ROWS
from compile_attn.attention.triton.metadata import ExtendStep
from compile_attn.attention.triton.verify_mode import VerifyStep
from compile_attn.layer import AttentionLayer

F32 = torch.float32
# Small splits so that prefixes of a few dozen tokens take several KV splits per request.
_TRITON_CPU = {"split_size": 32, "max_kv_splits": 4}
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter runs where there is no GPU")


@pytest.fixture(autouse=True, scope="module")
def _verify_mode_on():  # noqa: ANN202
    """The verify mode is on unless ``COMPILE_ATTN_VERIFY_MODE`` = 0: these tests are about it, whatever the
    environment says."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("COMPILE_ATTN_VERIFY_MODE", raising=False)
        yield


def _chains(prefix: tuple[int, ...], q: int, **kw: object) -> VerifyCase:
    return VerifyCase(prefix, tuple(tuple(range(-1, q - 1)) for _ in prefix), **kw)


@st.composite
def uniform_chain_cases(draw: st.DrawFn) -> VerifyCase:
    """1-3 requests verifying the same 1-5 tokens over prefixes of 0-70 tokens, GQA 1 or 4, page 1 or 4, softcap."""
    prefix = tuple(draw(st.lists(st.integers(0, 70), min_size=1, max_size=3)))
    return _chains(prefix, draw(st.integers(1, 5)), group=draw(st.sampled_from([1, 4])),
                   page_size=draw(st.sampled_from([1, 4])), logit_cap=draw(st.sampled_from([0.0, 0.0, 5.0])))


@settings(max_examples=8, deadline=None)
@given(case=uniform_chain_cases(), seed=st.integers(0, 2**16))
def test_uniform_chains_run_in_verify_mode_like_the_reference(case: VerifyCase, seed: int) -> None:
    run = run_verify(case, "triton", "cpu", F32, seed=seed, backend_kwargs=_TRITON_CPU, tree=False)
    step = run.backend.step_metadata
    assert isinstance(step, VerifyStep) and not step.graph_bound
    assert (step.batch_size, step.tokens_per_request) == (len(case.prefix), case.extend[0])
    assert max(run.errors()) <= TOL[F32], run.errors()


@pytest.mark.parametrize("case, bucket", [
    pytest.param(_chains((45, 0, 9), 4), 8, id="3-of-8-requests-q4"),
    pytest.param(_chains((70,), 3, group=4, page_size=4, logit_cap=5.0), 2, id="1-of-2-gqa4-p4-cap"),
    pytest.param(_chains((33, 64), 5), 2, id="unpadded-q5"),
])
def test_a_padded_verify_graph_view_binds_the_static_buffers(case: VerifyCase, bucket: int) -> None:
    """The runner's verify view (requests padded to the bucket on the scratch row): metadata over the static decode
    buffers, real tokens like the reference, padded rows finite (run_verify refuses NaN) and live KV untouched."""
    run = run_verify(case, "triton", "cpu", F32, backend_kwargs=_TRITON_CPU, tree=False, graph_bucket=bucket)
    step = run.backend.step_metadata
    assert isinstance(step, VerifyStep) and step.graph_bound
    assert step.batch_size == bucket and run.batch.num_tokens == bucket * case.extend[0]
    assert step.index.kv_indptr.data_ptr() == run.backend.graph_buffers.indexes[None].kv_indptr.data_ptr()
    assert max(run.errors()) <= TOL[F32], run.errors()  # reads the live requests' KV after the padded stores


@pytest.mark.parametrize("case", [
    pytest.param(VerifyCase((7, 3), ((-1, 0, 1), (-1, 0))), id="chains-of-two-lengths"),
    pytest.param(_chains((7, 3), 3, window=2), id="sliding-window"),
])
def test_other_chain_verify_batches_keep_the_extend_path(case: VerifyCase) -> None:
    run = run_verify(case, "triton", "cpu", F32, backend_kwargs=_TRITON_CPU, tree=False)
    assert isinstance(run.backend.step_metadata, ExtendStep) and run.backend.verify.steps == 0
    assert max(run.errors()) <= TOL[F32]


def test_verify_mode_support_is_declared_per_backend() -> None:
    kv = KVCache(num_layers=2, num_kv_heads=2, head_dim=64, max_batch_size=2, max_context=16, kv_cache_tokens=64)
    gqa8 = [AttentionLayer(0, 16, 2, 64), AttentionLayer(1, 16, 2, 64)]
    triton = create_backend("triton", kv, gqa8)
    assert triton.supports_verify_mode(MAX_VERIFY_ROWS // 8) and not triton.supports_verify_mode(MAX_VERIFY_ROWS // 8 + 1)
    windowed = [AttentionLayer(0, 4, 2, 64, sliding_window=8), AttentionLayer(1, 4, 2, 64)]
    assert not create_backend("triton", kv, windowed).supports_verify_mode(2)
    assert not create_backend("torch_native", kv, gqa8).supports_verify_mode(2)  # the base class's default


def test_verify_mode_switched_off(monkeypatch) -> None:  # noqa: ANN001
    """``COMPILE_ATTN_VERIFY_MODE=0``: the triton backend declares no verify mode, so chain verify steps run as decode
    rows in the decode graphs and no verify graphs are captured; on by default."""
    kv = KVCache(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=2, max_context=16, kv_cache_tokens=64)
    assert create_backend("triton", kv, [AttentionLayer(0, 8, 2, 64)]).supports_verify_mode(2)
    monkeypatch.setenv("COMPILE_ATTN_VERIFY_MODE", "0")
    assert not create_backend("triton", kv, [AttentionLayer(0, 8, 2, 64)]).supports_verify_mode(2)



def _trees(prefix: tuple[int, ...], q: int, seed: int, **kw: object) -> VerifyCase:
    """Requests over ``prefix`` each verifying a random tree of ``q`` tokens (seeded parents)."""
    rng = random.Random(seed)
    return VerifyCase(prefix, tuple((-1, *(rng.randrange(i) for i in range(1, q))) for _ in prefix), **kw)


@pytest.mark.parametrize("case", [
    pytest.param(_trees((45, 0, 9), 5, seed=1), id="3-requests-q5"),
    pytest.param(_trees((70, 30), 4, seed=2, group=4, page_size=4, logit_cap=5.0), id="gqa4-p4-cap"),
])
def test_uniform_trees_run_in_verify_mode_with_a_tree_mask(case: VerifyCase) -> None:
    """Draft trees whose requests all verify Q tokens: the verify mode with each row's ancestor bits, like the
    reference (prefix, ancestors and itself; positions prefix + depth are the batch's own)."""
    run = run_verify(case, "triton", "cpu", F32, backend_kwargs=_TRITON_CPU)
    step = run.backend.step_metadata
    assert isinstance(step, VerifyStep) and not step.graph_bound and step.tree_mask is not None
    assert run.backend.verify.tree_steps == 1
    assert max(run.errors()) <= TOL[F32], run.errors()


@pytest.mark.parametrize("case, bucket", [
    pytest.param(_trees((45, 0, 9), 4, seed=3), 8, id="3-of-8-requests-q4"),
    pytest.param(_trees((70,), 3, seed=4, group=4, page_size=4), 2, id="1-of-2-gqa4-p4"),
])
def test_a_padded_tree_verify_view_binds_the_static_tree_mask(case: VerifyCase, bucket: int) -> None:
    """A tree verify graph's view (padded requests as chains): the ancestor bits in the static buffer a captured graph
    reads, the real tokens like the reference."""
    run = run_verify(case, "triton", "cpu", F32, backend_kwargs=_TRITON_CPU, graph_bucket=bucket)
    step = run.backend.step_metadata
    assert isinstance(step, VerifyStep) and step.graph_bound and step.batch_size == bucket
    assert step.tree_mask.data_ptr() == run.backend.graph_buffers.tree_mask.data_ptr()
    assert max(run.errors()) <= TOL[F32], run.errors()


def test_trees_of_different_lengths_keep_the_extend_path() -> None:
    run = run_verify(VerifyCase((7, 3), ((-1, 0, 0), (-1, 0))), "triton", "cpu", F32, backend_kwargs=_TRITON_CPU)
    assert isinstance(run.backend.step_metadata, ExtendStep) and run.backend.verify.steps == 0
    assert max(run.errors()) <= TOL[F32]
