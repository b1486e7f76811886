"""build_decode_metadata (one launch) against plain Python over req_to_token, and against the three-call path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.attention.kernels.kernel_reference import DEVICE, make_paged_cache

from compile_attn.attention.kernels import build_decode_metadata, compute_num_kv_splits
from compile_attn.attention.kernels import decode_metadata as dm
from compile_attn.attention.kernels.decode_attention import PROGRAMS_PER_SM


def _expected_splits(lens: list[int], num_sms: int, max_splits: int, deterministic: bool, split_size: int,
                     num_kv_heads: int) -> list[int]:
    """The split rule written out in Python integers (decode_attention.compute_num_kv_splits' docstring)."""
    if deterministic:
        splits = [-(-n // split_size) for n in lens]
    else:
        target = max(1, num_sms * PROGRAMS_PER_SM)
        per_split = max(-(-(sum(lens) * num_kv_heads) // target), split_size)
        splits = [-(-n // per_split) for n in lens]
    return [min(max(s, 1), max_splits) for s in splits]


def _check(lengths, page_size, window, deterministic, num_sms, max_splits, split_size, num_kv_heads, seed):
    gen = torch.Generator().manual_seed(seed)
    cache = make_paged_cache(lengths, 1, 4, 4, page_size, torch.float32, gen)
    bs = len(lengths)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    starts = [max(n - window, 0) if window is not None else 0 for n in lengths]
    lens = [n - s for n, s in zip(lengths, starts)]
    total = sum(lens)
    # stale values everywhere (a static buffer holds the previous step's); one sentinel past the end
    indptr = torch.full((bs + 1,), -7, dtype=torch.int32, device=DEVICE)
    indices = torch.full((total + 1,), -1, dtype=torch.int32, device=DEVICE)
    splits = torch.full((bs,), -3, dtype=torch.int32, device=DEVICE)
    kv_start = torch.full((bs,), -5, dtype=torch.int32, device=DEVICE) if window is not None else None
    build_decode_metadata(cache.req_to_token, cache.rows, seq_lens, indptr, indices, splits, num_sms=num_sms,
                          max_kv_splits=max_splits, deterministic=deterministic, split_size=split_size,
                          num_kv_heads=num_kv_heads, window=window, kv_start=kv_start)
    assert indptr.tolist() == [0] + torch.tensor(lens).cumsum(0).tolist()
    expected = torch.cat([cache.slots(b, starts[b]) for b in range(bs)])
    assert torch.equal(indices[:total].long().cpu(), expected.cpu())
    assert indices[total].item() == -1, "wrote past the step's slots"
    want = _expected_splits(lens, num_sms, max_splits, deterministic, split_size, num_kv_heads)
    assert splits.tolist() == want
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    assert splits.tolist() == compute_num_kv_splits(lens_t, num_sms, max_splits, deterministic, split_size,
                                                    num_kv_heads=num_kv_heads).tolist()
    if window is not None:
        assert kv_start.tolist() == starts


@settings(max_examples=20, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 700), min_size=1, max_size=9),
    page_size=st.sampled_from([1, 16]),
    window=st.one_of(st.none(), st.integers(1, 300)),
    deterministic=st.booleans(),
    num_sms=st.integers(1, 8),
    max_splits=st.integers(1, 16),
    split_size=st.sampled_from([16, 64]),
    num_kv_heads=st.sampled_from([1, 8]),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_python_over_req_to_token(lengths, page_size, window, deterministic, num_sms, max_splits,
                                          split_size, num_kv_heads, seed):
    _check(lengths, page_size, window, deterministic, num_sms, max_splits, split_size, num_kv_heads, seed)


@pytest.mark.parametrize("window", [None, 50])
def test_batches_over_the_one_block_limit_take_the_three_call_path(monkeypatch, window):
    monkeypatch.setattr(dm, "MAX_BATCH", 2)
    _check([90, 0, 300, 17], 16, window, False, 2, 8, 16, 8, seed=3)


def test_a_window_needs_a_start_buffer():
    t = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="kv_start"):
        build_decode_metadata(torch.zeros(2, 8, dtype=torch.int32, device=DEVICE), t, t, torch.zeros(3, dtype=torch.int32),
                              t, t, num_sms=4, max_kv_splits=4, window=16)


def test_a_batch_past_the_shared_block_size():
    lengths = torch.randint(0, 40, (dm.MIN_BLOCK_B + 44,), generator=torch.Generator().manual_seed(5)).tolist()
    _check(lengths, 1, None, False, 132, 16, 64, 8, seed=5)


def test_default_decode_buckets_share_one_compiled_kernel():
    """Each distinct block size is one Triton compile (~0.2 s of start time on the H100 machine)."""
    from compile_attn.config import DEFAULT_DECODE_BATCH_SIZES

    assert {dm.batch_block(bs) for bs in DEFAULT_DECODE_BATCH_SIZES} == {dm.MIN_BLOCK_B}
