"""Padding: bucket lookup, the replay view's contents, and padded tokens never writing live KV slots."""

from __future__ import annotations

import pytest
import torch
from tests.graph_runner.gr_helpers import CountingBackend, Twin, make_model

from compile_attn.batch import PAD_REQUEST, PAD_SLOT
from compile_attn.config import GraphConfig
from compile_attn.graph_runner import GraphRunner, ReplayViews, StaticBuffers
from compile_attn.graph_runner.replay_view import next_bucket


def test_next_bucket() -> None:
    buckets = (1, 2, 4, 8, 16, 24)
    assert [next_bucket(buckets, n) for n in (1, 2, 3, 5, 8, 9, 17, 24, 25)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        24,
        24,
        None,
    ]
    assert next_bucket((), 1) is None


def test_decode_view_pads_requests_with_the_scratch_row() -> None:
    twin = Twin()
    twin.step(twin.new_requests(3), [5, 6, 7])
    fb = twin.decode_step(3).runner_batch
    views = ReplayViews(StaticBuffers(8, 64, "cpu"), seq_len_fill=1)
    view = views.decode_view(fb, 4)
    assert (view.batch_size, view.real_batch_size, view.graph_bucket, view.num_tokens) == (4, 3, 4, 4)
    assert view.req_pool_indices.tolist() == fb.req_pool_indices.tolist() + [PAD_REQUEST]
    assert view.seq_lens.tolist() == fb.seq_lens.tolist() + [1]
    assert view.seq_lens_cpu.tolist() == fb.seq_lens_cpu.tolist() + [1]
    assert view.out_cache_loc.tolist() == fb.out_cache_loc.tolist() + [PAD_SLOT]
    assert view.input_ids.tolist() == fb.input_ids.tolist() + [0]
    assert view.extend_seq_lens.tolist() == [1] * 4 and view.extend_start_loc.tolist() == [0, 1, 2, 3]
    view.validate(twin.caches[0])


def test_extend_view_pads_tokens_that_belong_to_no_request() -> None:
    twin = Twin()
    fb = twin.extend_step(21, 3).runner_batch
    views = ReplayViews(StaticBuffers(8, 64, "cpu"), seq_len_fill=1)
    views.decode_view(twin.decode_step(2).runner_batch, 8)  # leave decode state behind first
    view = views.extend_view(fb, 32)
    assert (view.batch_size, view.num_tokens, view.num_request_tokens, view.graph_bucket) == (
        fb.batch_size,
        32,
        21,
        32,
    )
    assert view.out_cache_loc[21:].tolist() == [PAD_SLOT] * 11
    assert view.positions[21:].tolist() == [0] * 11
    assert view.positions[:21].tolist() == fb.positions.tolist()
    assert view.extend_seq_lens.tolist() == fb.extend_seq_lens.tolist()
    assert view.extend_start_loc.tolist() == fb.extend_start_loc.tolist()
    view.validate(twin.caches[0])
    # and back to decode: the extend fields get the decode layout again
    back = views.decode_view(twin.decode_step(2).runner_batch, 4)
    assert back.extend_seq_lens.tolist() == [1] * 4 and back.extend_start_loc.tolist() == [0, 1, 2, 3]
    assert back.out_cache_loc[2:].tolist() == [PAD_SLOT] * 2


def test_copy_destinations_are_kept_for_decode_shapes_only() -> None:
    """Decode steps reuse their bucket's copy destinations and still see each step's live values; extend steps of
    any token count keep nothing (a server's mix of prompt lengths must not grow a cache)."""
    twin = Twin()
    twin.step(twin.new_requests(3), [5, 6, 7])
    views = ReplayViews(StaticBuffers(8, 64, "cpu"), seq_len_fill=1)
    for bs in (3, 2, 3, 2):
        fb = twin.decode_step(bs).runner_batch
        view = views.decode_view(fb, 4)
        assert view.input_ids[:bs].tolist() == fb.input_ids.tolist()
        assert view.out_cache_loc[:bs].tolist() == fb.out_cache_loc.tolist()
        assert view.seq_lens[:bs].tolist() == fb.seq_lens.tolist()
        assert view.req_pool_indices[bs:].tolist() == [PAD_REQUEST] * (4 - bs)
    for tokens in (5, 9, 14, 20):
        fb = twin.extend_step(tokens, 2).runner_batch
        view = views.extend_view(fb, 32)
        assert view.positions[:tokens].tolist() == fb.positions.tolist()
        assert view.extend_seq_lens[: fb.batch_size].tolist() == fb.extend_seq_lens.tolist()
    assert sorted(views._copy_targets) == [(2, 2), (3, 3)]


def _pool_snapshot(kv) -> list[torch.Tensor]:
    return [b.clone() for b in (*kv.pool.k_buffers, *kv.pool.v_buffers)]


def _changed_slots(before: list[torch.Tensor], kv) -> set[int]:
    changed: set[int] = set()
    for old, new in zip(before, (*kv.pool.k_buffers, *kv.pool.v_buffers)):
        diff = (old != new).flatten(1).any(dim=1)
        changed |= set(torch.nonzero(diff).flatten().tolist())
    return changed


@pytest.mark.parametrize("mode", ["full_and_piecewise", "breakable"])
def test_padded_tokens_never_touch_live_kv_slots(mode: str) -> None:
    """Shrinking batches inside one bucket leave stale live slots in the static buffers; they must be re-padded."""
    model = make_model()
    twin = Twin(seed=7)
    kv = twin.caches[0]
    config = GraphConfig(
        mode=mode, decode_batch_sizes=(1, 2, 4, 8), extend_token_sizes=(16, 32, 64), cache_dir=None
    )
    runner = GraphRunner(
        model, CountingBackend(kv, model.attention_layers()), config, max_batch_size=8, max_num_tokens=64
    )
    runner.capture()
    twin.step(twin.new_requests(8), [3, 4, 5, 6, 7, 8, 9, 10])
    runner_steps = [
        twin.decode_step(7),
        twin.decode_step(5),
        twin.decode_step(3),
        twin.extend_step(30, 3),
        twin.extend_step(17, 2),
        twin.decode_step(6),
    ]
    for step in runner_steps:
        fb = step.runner_batch
        before = _pool_snapshot(kv)
        runner.run(fb)
        allowed = set(fb.out_cache_loc.tolist()) | {PAD_SLOT}
        touched = _changed_slots(before, kv)
        assert touched - allowed == set(), f"{step.kind} of {fb.batch_size} wrote slots {touched - allowed}"
        assert touched & set(fb.out_cache_loc.tolist()), "the step must write its own slots (test sanity)"
    assert runner.stats.eager_fallbacks == 0
