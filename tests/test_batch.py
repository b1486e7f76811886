"""ForwardBatch construction and validate(): every inconsistency names the field and the values."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from compile_attn import ForwardBatch, ForwardMode, InvalidBatchError, KVCache


def _batch(**over) -> ForwardBatch:
    args = dict(req_pool_indices=[1, 2], prefix_lens=[3, 0], extend_lens=[1, 4], out_cache_loc=[5, 6, 7, 8, 9])
    args.update(over)
    return ForwardBatch.build(**args)


def test_build_derives_positions_lengths_and_mode() -> None:
    fb = _batch()
    assert fb.forward_mode is ForwardMode.MIXED  # request 0 decodes, request 1 prefills
    assert _batch(prefix_lens=[0, 0]).forward_mode is ForwardMode.EXTEND
    assert fb.positions.tolist() == [3, 0, 1, 2, 3]
    assert fb.seq_lens.tolist() == [4, 4] and fb.seq_lens_sum == 8
    assert fb.extend_start_loc.tolist() == [0, 1]
    assert fb.num_tokens == 5 and fb.real_batch_size == 2
    fb.validate()
    decode = _batch(prefix_lens=[3, 2], extend_lens=[1, 1], out_cache_loc=[5, 6])
    assert decode.forward_mode is ForwardMode.DECODE
    assert decode.positions.tolist() == [3, 2] and decode.positions.dtype == torch.int64  # the decode shortcut
    assert ForwardBatch.build(req_pool_indices=[], prefix_lens=[], extend_lens=[], out_cache_loc=[]).forward_mode \
        is ForwardMode.IDLE


def test_build_accepts_tensors_and_lists_and_keeps_dtypes() -> None:
    fb = _batch(out_cache_loc=torch.tensor([5, 6, 7, 8, 9], dtype=torch.int32), input_ids=[11, 12, 13, 14, 15],
                positions=torch.tensor([3, 0, 1, 2, 3]))
    longs = (fb.input_ids, fb.positions, fb.req_pool_indices, fb.out_cache_loc)
    ints = (fb.seq_lens, fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start_loc)
    assert all(t.dtype == torch.int64 for t in longs) and all(t.dtype == torch.int32 for t in ints)
    assert fb.out_cache_loc.tolist() == [5, 6, 7, 8, 9] and fb.input_ids.tolist() == [11, 12, 13, 14, 15]
    assert fb.req_pool_indices.tolist() == [1, 2] and fb.extend_prefix_lens.tolist() == [3, 0]
    assert fb.extend_seq_lens.tolist() == [1, 4] and fb.seq_lens_cpu.tolist() == [4, 4]
    fb.validate()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(out_cache_loc=torch.tensor([5, 6, 7])), "input_ids has 5 entries but out_cache_loc has 3"),
        (dict(seq_lens=torch.tensor([4], dtype=torch.int32)), "seq_lens has 1 entries but batch_size is 2"),
        (dict(extend_prefix_lens_cpu=[-1, 0]), "must be non-negative, got prefix_len=-1"),
        (dict(extend_prefix_lens_cpu=[5, 0]), "prefix_len 5 is longer than its sequence \\(seq_len 4\\)"),
        (dict(extend_seq_lens_cpu=[2, 4]), "seq_len 4 != prefix_len 3 \\+ extend_len 2"),
        (dict(seq_lens_sum=9), "seq_lens_sum is 9 but seq_lens sum to 8"),
        (dict(forward_mode=ForwardMode.DECODE), "DECODE needs extend_len 1 for every request, got \\[1, 4\\]"),
        (dict(seq_lens=torch.tensor([4, 5], dtype=torch.int32)), "seq_lens on device \\[4, 5\\] differ"),
    ],
)
def test_validate_rejects_inconsistent_batches(change: dict, message: str) -> None:
    fb = dataclasses.replace(_batch(), **change)
    with pytest.raises(InvalidBatchError, match=message):
        fb.validate()


def test_validate_against_the_cache_checks_slots_rows_and_context() -> None:
    kv = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, max_batch_size=2, max_context=8, kv_cache_tokens=16)
    rows = [kv.alloc_request(), kv.alloc_request()]
    assert rows == [1, 2]
    kv.alloc_extend(rows, [3, 0])
    loc = kv.alloc_extend(rows, [1, 4]).tolist()
    assert loc == [4, 5, 6, 7, 8]
    with pytest.raises(InvalidBatchError, match="out_cache_loc holds slots in \\[5, 99\\]"):
        _batch(out_cache_loc=[5, 6, 7, 8, 99]).validate(kv)
    with pytest.raises(InvalidBatchError, match="req_pool_indices in \\[1, 3\\]"):
        _batch(req_pool_indices=[1, 3]).validate(kv)
    with pytest.raises(InvalidBatchError, match="seq_len 9 exceeds the KV cache's max_context 8"):
        _batch(prefix_lens=[8, 0]).validate(kv)
    with pytest.raises(InvalidBatchError, match="prefix_len 4 \\+ extend_len 1 = 5 tokens but the row has 4"):
        _batch(prefix_lens=[4, 0], out_cache_loc=loc).validate(kv)
    with pytest.raises(InvalidBatchError, match="request row 1 appears twice in one batch"):
        _batch(req_pool_indices=[1, 1], prefix_lens=[0, 0], extend_lens=[1, 1], out_cache_loc=[1, 2]).validate(kv)
    with pytest.raises(InvalidBatchError, match="out_cache_loc\\[0\\] is slot 5, but token 0 \\(request row 1, "
                                                "position 3\\) has slot 4"):
        _batch().validate(kv)
    _batch(out_cache_loc=loc).validate(kv)


def test_padding_tokens_only_allowed_in_graph_views() -> None:
    with pytest.raises(InvalidBatchError, match="sum to 5 tokens but out_cache_loc has 7 entries"):
        _batch(out_cache_loc=[5, 6, 7, 8, 9, 0, 0])
    fb = dataclasses.replace(_batch(), out_cache_loc=torch.tensor([5, 6, 7, 8, 9, 0, 0]),
                             input_ids=torch.zeros(7, dtype=torch.int64), positions=torch.tensor([3, 0, 1, 2, 3, 0, 0]))
    with pytest.raises(InvalidBatchError, match="padding tokens are only allowed in graph-bucket views"):
        fb.validate()
    fb.graph_bucket = 8
    fb.validate()
