"""``tests.attention.harness.chunked_reference`` (the vectorised, query-chunked float64 reference the GPU triton tests use for
long sequences) against ``reference.reference_attention`` (the per-token one every other test uses): the same
outputs over random batches, prefix lengths, page sizes, GQA ratios, windows, softcaps, causal or not, and chunk
sizes smaller than a request's new tokens. Plain torch on the CPU."""

from __future__ import annotations

import torch
from tests.batch_factory import random_step
from hypothesis import given
from hypothesis import strategies as st
from tests.reference import reference_attention
from tests.attention.harness import Case, chunked_reference


@st.composite
def batches(draw: st.DrawFn) -> tuple[Case, dict]:
    bs = draw(st.integers(1, 4))
    case = Case(
        prefix=tuple(draw(st.lists(st.integers(0, 30), min_size=bs, max_size=bs))),
        extend=tuple(draw(st.lists(st.integers(1, 9), min_size=bs, max_size=bs))),
        num_kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 3, 4])),
        page_size=draw(st.sampled_from([1, 4])),
        head_dim=16,
        v_head_dim=draw(st.sampled_from([None, 8])),
    )
    options = dict(sliding_window=draw(st.sampled_from([None, 1, 5])), logit_cap=draw(st.sampled_from([0.0, 3.0])),
                   causal=draw(st.booleans()))
    return case, options


@given(batches(), st.integers(1, 4), st.integers(0, 2**16))
def test_chunked_reference_equals_the_per_token_reference(batch: tuple[Case, dict], chunk: int, seed: int) -> None:
    case, options = batch
    kv = case.make_kv("cpu", torch.float32)
    step = random_step(kv, list(case.prefix), list(case.extend), case.num_heads, torch.Generator().manual_seed(seed),
                       dtype=torch.float32)
    args = (step.q, step.k, step.v, *kv.pool.get_kv(0), kv.req_to_token, step.rows, step.prefix_lens,
            step.extend_lens)
    scaling = case.head_dim**-0.5
    expected = reference_attention(*args, scaling=scaling, **options)
    got = chunked_reference(*args, scaling=scaling, chunk=chunk, **options)
    assert got.dtype == expected.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
