"""host_tensors: fast int-list conversion and ragged index math, against plain Python loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_attn import host_tensors
from compile_attn.host_tensors import int_tensor, ragged_arange, repeat_each, to_device, to_device_groups

ints64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
ints32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)


@given(st.lists(ints64, max_size=50))
def test_int_tensor_int64_matches_torch_tensor(values: list[int]) -> None:
    out = int_tensor(values)
    assert out.dtype == torch.int64 and out.device.type == "cpu"
    assert out.tolist() == values


@given(st.lists(ints32, max_size=50))
def test_int_tensor_int32_matches_torch_tensor(values: list[int]) -> None:
    out = int_tensor(values, torch.int32)
    assert out.dtype == torch.int32
    assert out.tolist() == values


def test_int_tensor_refuses_values_that_do_not_fit_and_other_dtypes() -> None:
    with pytest.raises(OverflowError):
        int_tensor([2**31], torch.int32)
    with pytest.raises(TypeError, match="int64 or int32"):
        int_tensor([1], torch.float32)
    with pytest.raises(TypeError):
        int_tensor([1.5])


def test_int_tensor_outlives_its_buffer() -> None:
    out = int_tensor(list(range(1000)))
    garbage = [list(range(1000)) for _ in range(100)]  # reuse freed memory if the buffer were gone
    assert out.sum().item() == sum(range(1000)) and garbage


@settings(max_examples=60)
@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 40)), max_size=12))
def test_ragged_arange_and_repeat_each_match_loops(runs: list[tuple[int, int]]) -> None:
    starts, lens = [s for s, _ in runs], [n for _, n in runs]
    want_pos = [s + i for s, n in runs for i in range(n)]
    values = [7 * i for i in range(len(runs))]
    want_rep = [7 * i for i, (_, n) in enumerate(runs) for _ in range(n)]
    small = sum(lens) <= host_tensors.SMALL_TOKENS
    for pos, rep in ((ragged_arange(starts, lens), repeat_each(values, lens)),
                     (ragged_arange(tuple(starts), tuple(lens)), repeat_each(tuple(values), tuple(lens)))):
        # lists of few tokens come back as lists of Python ints, more tokens as int64 arrays
        for out, want in ((pos, want_pos), (rep, want_rep)):
            if small:
                assert type(out) is list and all(type(x) is int for x in out) and out == want
            else:
                assert out.dtype == np.int64 and out.tolist() == want
    # arrays always take the NumPy path
    pos = ragged_arange(np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int32))
    assert pos.dtype == np.int64 and pos.tolist() == want_pos
    rep = repeat_each(values, np.asarray(lens, dtype=np.int32))
    assert rep.dtype == np.int64 and rep.tolist() == want_rep


def test_ragged_helpers_switch_to_arrays_past_small_tokens() -> None:
    n = host_tensors.SMALL_TOKENS
    assert type(ragged_arange([3], [n])) is list and type(repeat_each([3], [n])) is list
    pos, rep = ragged_arange([3, 0], [n, 1]), repeat_each([3, 4], [n, 1])
    assert pos.dtype == np.int64 and pos.tolist() == list(range(3, 3 + n)) + [0]
    assert rep.dtype == np.int64 and rep.tolist() == [3] * n + [4]
    # both forms upload to the same values
    small, large = ragged_arange([5, 9], [2, 3]), ragged_arange(np.asarray([5, 9]), np.asarray([2, 3]))
    (a, b) = to_device([small, large], torch.int64, torch.device("cpu"))
    assert a.tolist() == b.tolist() == [5, 6, 9, 10, 11]


def test_ragged_helpers_refuse_negative_lengths() -> None:
    big = host_tensors.SMALL_TOKENS + 10  # the array path as well as the list path
    for lens in ([3, -1], [big, -1]):
        with pytest.raises(ValueError, match="non-negative"):
            ragged_arange([0, 5], lens)
        with pytest.raises(ValueError, match="non-negative"):
            repeat_each([0, 5], lens[::-1])


def test_to_device_packs_lists_and_host_tensors_and_keeps_shapes() -> None:
    parts = [[1, 2, 3], torch.tensor([[4, 5], [6, 7]], dtype=torch.int32), torch.tensor(8), []]
    out = to_device(parts, torch.int64, torch.device("cpu"))
    assert [t.dtype for t in out] == [torch.int64] * 4
    assert [t.tolist() for t in out] == [[1, 2, 3], [[4, 5], [6, 7]], [8], []]
    lists = to_device([[1, 2], (3,), [], [2**31 - 1]], torch.int32, torch.device("cpu"))  # lists only: one tensor
    assert [t.dtype for t in lists] == [torch.int32] * 4 and [t.tolist() for t in lists] == [[1, 2], [3], [], [2**31 - 1]]
    with pytest.raises(OverflowError):
        to_device([[2**31]], torch.int32, torch.device("cpu"))


@settings(max_examples=40)
@given(parts=st.lists(st.one_of(st.lists(ints32, max_size=6), st.lists(ints32, max_size=6).map(np.asarray),
                          st.lists(ints32, max_size=6).map(lambda v: torch.tensor(v, dtype=torch.int64))),
                max_size=5),
       dtype=st.sampled_from([torch.int32, torch.int64]))
def test_to_device_mixes_lists_arrays_and_tensors(parts: list, dtype: torch.dtype) -> None:
    out = to_device(parts, dtype, torch.device("cpu"))
    assert [t.dtype for t in out] == [dtype] * len(parts)
    assert [t.tolist() for t in out] == [list(map(int, p)) for p in parts]


@settings(max_examples=40)
@given(groups=st.lists(st.tuples(st.lists(st.one_of(st.lists(ints32, max_size=5),
                                                    st.lists(ints32, max_size=5).map(np.asarray)), max_size=4),
                                  st.sampled_from([torch.int32, torch.int64])), max_size=4))
def test_to_device_groups_sends_every_dtype_in_one_copy(groups: list) -> None:
    """Each group comes back as to_device alone would give it (values, dtypes); all of them through one upload."""
    uploads = []
    real = host_tensors.upload
    host_tensors.upload = lambda t, d: uploads.append(t) or real(t, d)
    try:
        out = to_device_groups(groups, torch.device("cpu"))
    finally:
        host_tensors.upload = real
    assert len(uploads) == (1 if any(parts for parts, _ in groups) else 0)
    for (parts, dtype), tensors in zip(groups, out):
        assert [t.dtype for t in tensors] == [dtype] * len(parts)
        assert [t.tolist() for t in tensors] == [list(map(int, p)) for p in parts]


def test_to_device_refuses_array_values_that_do_not_fit() -> None:
    with pytest.raises(OverflowError, match="2147483648"):
        to_device([np.array([1, 2**31])], torch.int32, torch.device("cpu"))
    with pytest.raises(OverflowError):
        to_device([torch.tensor([-(2**31) - 1])], torch.int32, torch.device("cpu"))
    with pytest.raises(TypeError, match="int64 or int32"):
        to_device([[1]], torch.float32, torch.device("cpu"))


@pytest.mark.gpu
@settings(max_examples=10, deadline=None)
@given(prefix=st.lists(st.integers(0, 40), min_size=1, max_size=6), seed=st.integers(0, 2**31 - 1),
       page_size=st.sampled_from([1, 16]))
def test_step_metadata_reaches_the_gpu_without_a_sync(prefix: list[int], seed: int, page_size: int) -> None:
    """Slot allocation and batch building of a step enqueue their copies and never wait for the GPU (pinned
    uploads, ragged expansion on the host), and give the same batch as on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from compile_attn import KVCache
    from compile_attn.batch import ForwardBatch

    gen = torch.Generator().manual_seed(seed)
    extend = torch.randint(1, 50, (len(prefix),), generator=gen).tolist()
    built = {}
    for device in ("cpu", "cuda"):
        kv = KVCache(num_layers=1, num_kv_heads=1, head_dim=8, max_batch_size=8, max_context=128, kv_cache_tokens=2048,
                     page_size=page_size, dtype=torch.bfloat16, device=device)
        rows = [kv.alloc_request() for _ in prefix]
        kv.alloc_extend(rows, prefix)
        ids = torch.randint(0, 1000, (sum(extend),), generator=torch.Generator().manual_seed(seed)).tolist()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # a blocking copy or a read-back raises
        try:
            loc = kv.alloc_extend(rows, extend)
            fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=prefix, extend_lens=extend,
                                    out_cache_loc=loc, input_ids=ids, device=device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        built[device] = (kv.req_to_token.cpu(), fb.input_ids.cpu(), fb.positions.cpu(), fb.out_cache_loc.cpu(),
                         fb.seq_lens.cpu())
    for a, b in zip(built["cpu"], built["cuda"]):
        assert torch.equal(a, b)
    positions = [p + i for p, n in zip(prefix, extend) for i in range(n)]
    assert built["cuda"][2].tolist() == positions
