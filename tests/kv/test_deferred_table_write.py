"""A decode allocation whose request-table write is left to its step (``KVCache.alloc_extend(...,
defer_table_write=True)``, ``ForwardBatch.table_write_pending``).

Written by the decode copy kernel (interpreted on the CPU), by the torch ops that run without Triton, or by the
batch itself (``write_pending_table``, the eager and extend routes), the table after every step is what a plain
Python reference derives from each row's pages, and what a twin cache that writes at allocation holds: page sizes
1 and 4, shuffled free pages, the step's fields at unaligned offsets of their upload. Batches that cannot be
trusted with a pending write are refused, and an engine whose decode steps take every route gives the same tokens.
Verify steps (several new tokens per request, chains and trees) defer their write too.
"""

from __future__ import annotations

import array
import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_attn import InvalidBatchError, KVCache
from compile_attn.graph_runner import step_kernels
from compile_attn.batch import ForwardBatch, ForwardMode
from compile_attn.batch import PAD_SLOT
from compile_attn.graph_runner.step_kernels import copy_decode_inputs

MAX_CONTEXT = 40


def _cache(page_size: int, seed: int) -> KVCache:
    kv = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, max_batch_size=8, max_context=MAX_CONTEXT,
                 kv_cache_tokens=512, page_size=page_size, dtype=torch.float32)
    perm = torch.randperm(len(kv.allocator._free), generator=torch.Generator().manual_seed(seed)).tolist()
    kv.allocator._free = array.array("q", [kv.allocator._free[i] for i in perm])  # pages out of order
    return kv


def reference_table(kv: KVCache) -> list[list[int]]:
    """The request table as the rows' pages say it must be: position ``p`` of a row at slot
    ``pages[p // page_size] * page_size + p % page_size``, every other entry the scratch slot."""
    ps = kv.page_size
    table = [[PAD_SLOT] * kv.max_context for _ in range(kv.req_to_token_pool.num_rows)]
    for row, pages in kv._pages.items():
        for p in range(kv._lens[row]):
            table[row][p] = pages[p // ps] * ps + p % ps
    return table


def _at_offset(values: list[int], dtype: torch.dtype, offset: int) -> torch.Tensor:
    """``values`` as a view ``offset`` entries into a larger tensor (a field of a step's one upload)."""
    return torch.tensor([0] * offset + values, dtype=dtype)[offset:]


def _write(how: str, kv: KVCache, fb: ForwardBatch, offset: int) -> None:
    """The pending write of ``fb`` the way one route of a step does it."""
    if how == "batch":
        fb.write_pending_table(kv)
        return
    n = fb.batch_size
    srcs = [_at_offset(fb.input_ids.tolist(), torch.int64, offset), _at_offset(fb.positions.tolist(), torch.int64,
            offset), _at_offset(fb.out_cache_loc.tolist(), torch.int64, offset),
            _at_offset(fb.req_pool_indices.tolist(), torch.int64, offset),
            _at_offset(fb.seq_lens.tolist(), torch.int32, offset),
            _at_offset(fb.extend_prefix_lens.tolist(), torch.int32, offset)]
    dsts = [torch.empty(n + offset, dtype=s.dtype)[offset:] for s in srcs]
    with contextlib.ExitStack() as stack:
        if how == "torch":
            stack.enter_context(mock.patch.object(step_kernels, "kernels_usable", lambda t: False))
        copy_decode_inputs(dsts, srcs, None, kv.req_to_token)


@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=15, deadline=None)
@given(prefix=st.lists(st.integers(1, 20), min_size=1, max_size=6), steps=st.integers(1, 12),
       how=st.sampled_from(["kernel", "torch", "batch"]), offset=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_deferred_writes_give_the_table_the_pages_say(page_size: int, prefix: list[int], steps: int, how: str,
                                                      offset: int, seed: int) -> None:
    if how == "kernel" and not step_kernels.kernels_usable(torch.empty(0)):
        how = "torch"
    deferred, eager = _cache(page_size, seed), _cache(page_size, seed)
    for kv in (deferred, eager):
        rows = [kv.alloc_request() for _ in prefix]
        kv.alloc_extend(rows, prefix)
    for _ in range(steps):
        if max(deferred._lens[r] for r in rows) >= MAX_CONTEXT:
            break
        before = deferred.req_to_token.clone()
        starts = [deferred._lens[r] for r in rows]
        loc = deferred.alloc_extend(rows, [1] * len(rows), defer_table_write=True)
        assert loc.is_cpu and torch.equal(deferred.req_to_token, before)  # nothing written yet
        assert loc.tolist() == eager.alloc_extend(rows, [1] * len(rows)).tolist()
        fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=starts, extend_lens=[1] * len(rows),
                                out_cache_loc=loc, input_ids=[5] * len(rows), table_write_pending=True)
        fb.check(deferred)  # recognised as the allocation's batch: no table read
        _write(how, deferred, fb, offset)
        assert deferred.req_to_token.tolist() == reference_table(deferred)
        assert torch.equal(deferred.req_to_token, eager.req_to_token)


@pytest.mark.parametrize("page_size", [1, 4])
@settings(max_examples=15, deadline=None)
@given(prefix=st.lists(st.integers(1, 20), min_size=1, max_size=5), data=st.data(), tree=st.booleans(),
       route=st.sampled_from(["batch", "eager"]), seed=st.integers(0, 2**16))
def test_a_verify_steps_deferred_write_gives_the_table_the_pages_say(page_size: int, prefix: list[int],
                                                                     data: st.DataObject, tree: bool, route: str,
                                                                     seed: int) -> None:
    """Several new tokens per request (a verify step's last token and drafts, as a chain or a tree whose positions
    are not the table's): the step writes each token's slot at its row and table position, as a cache that writes
    at allocation does."""
    deferred, eager = _cache(page_size, seed), _cache(page_size, seed)
    for kv in (deferred, eager):
        rows = [kv.alloc_request() for _ in prefix]
        kv.alloc_extend(rows, prefix)
    lens = data.draw(st.lists(st.integers(1, 5), min_size=len(rows), max_size=len(rows)))
    before = deferred.req_to_token.clone()
    loc = deferred.alloc_extend(rows, lens, defer_table_write=True)
    assert loc.is_cpu and torch.equal(deferred.req_to_token, before)  # nothing written yet
    assert loc.tolist() == eager.alloc_extend(rows, lens).tolist()
    parents = [(-1, *(data.draw(st.integers(-1, i - 1)) + 1 for i in range(n - 1))) for n in lens] if tree else None
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=prefix, extend_lens=lens, out_cache_loc=loc,
                            input_ids=[5] * sum(lens), table_write_pending=True, draft_parents=parents,
                            forward_mode=ForwardMode.TARGET_VERIFY if tree else None)
    fb.check(deferred)  # recognised as the allocation's batch: no table read
    if route == "batch":
        fb.write_pending_table(deferred)
    else:
        from compile_attn.attention import create_backend
        from compile_attn.layer import AttentionLayer
        backend = create_backend("torch_native", deferred, [AttentionLayer(0, num_heads=1, num_kv_heads=1,
                                                                           head_dim=4)])
        backend.init_forward_metadata(fb)
    assert not fb.table_write_pending
    assert deferred.req_to_token.tolist() == reference_table(deferred)
    assert torch.equal(deferred.req_to_token, eager.req_to_token)


def test_a_pending_batch_of_several_tokens_needs_its_table_rows() -> None:
    """A pending batch of several tokens per request rebuilt field by field has lost its tokens' table rows: its
    write is refused, not done at the wrong positions."""
    import dataclasses

    kv = _cache(4, 0)
    rows = [kv.alloc_request(), kv.alloc_request()]
    kv.alloc_extend(rows, [3, 2])
    loc = kv.alloc_extend(rows, [3, 1], defer_table_write=True)
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[3, 2], extend_lens=[3, 1], out_cache_loc=loc,
                            table_write_pending=True)
    before = kv.req_to_token.clone()
    with pytest.raises(InvalidBatchError, match="no per-token table rows"):
        dataclasses.replace(fb).write_pending_table(kv)
    assert torch.equal(kv.req_to_token, before)


def test_a_pending_batch_is_refused_unless_it_is_its_allocation() -> None:
    """The table does not hold a pending batch's slots: only the allocation's own batch, before any free, runs."""
    kv = _cache(1, 0)
    rows = [kv.alloc_request(), kv.alloc_request()]
    kv.alloc_extend(rows, [3, 2])
    loc = kv.alloc_extend(rows, [1, 1], defer_table_write=True)
    copied = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[3, 2], extend_lens=[1, 1],
                                out_cache_loc=loc.clone(), table_write_pending=True)
    with pytest.raises(InvalidBatchError, match="write is pending"):
        copied.check(kv)
    own = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[3, 2], extend_lens=[1, 1], out_cache_loc=loc,
                             table_write_pending=True)
    own.check(kv)
    kv.free_request(kv.alloc_request())  # a free: issued batches are no longer trusted
    with pytest.raises(InvalidBatchError, match="write is pending"):
        own.check(kv)


def test_a_backend_eager_entry_writes_the_pending_table_first() -> None:
    """A pending batch handed straight to a backend's ``init_forward_metadata`` gets its table written before the
    metadata reads it, once (the flag is cleared)."""
    from compile_attn.attention import create_backend
    from compile_attn.layer import AttentionLayer

    kv = _cache(4, 3)
    backend = create_backend("torch_native", kv, [AttentionLayer(0, num_heads=1, num_kv_heads=1, head_dim=4)])
    rows = [kv.alloc_request(), kv.alloc_request()]
    kv.alloc_extend(rows, [6, 3])
    loc = kv.alloc_extend(rows, [1, 1], defer_table_write=True)
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[6, 3], extend_lens=[1, 1], out_cache_loc=loc,
                            table_write_pending=True)
    backend.init_forward_metadata(fb)
    assert not fb.table_write_pending
    assert kv.req_to_token.tolist() == reference_table(kv)


@pytest.mark.parametrize("graph_mode", ["full", "none"])
def test_engine_tokens_equal_recompute_on_every_route_of_a_pending_write(graph_mode: str) -> None:
    """Decode steps in a graph (written by the copy), over the largest bucket (eager: the backend's entry writes),
    and steps of one token per request that are not decode (a one-token prompt joining the decodes): every request's
    greedy tokens are an independent no-cache recompute's."""
    from compile_attn.engine import LLM, SamplingParams
    from compile_attn.models import ToyDecoder, ToyDecoderConfig
    from tests.greedy_reference import greedy_by_recompute

    torch.manual_seed(0)
    model = ToyDecoder(ToyDecoderConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                        head_dim=8, intermediate_size=64)).eval()
    llm = LLM(model, max_batch_size=4, max_num_tokens=24, kv_cache_tokens=256, max_context=64, page_size=4,
              graph_mode=graph_mode, compile=False, device="cpu", compile_options={"decode_batch_sizes": [1, 2]})
    prompts = [[(7 * i + j) % 97 for j in range(n)] for i, n in enumerate([5, 1, 9, 1, 13])]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=7))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_by_recompute(model, prompt, 7)
    runs = llm.step_runner.runner.stats.runs
    assert runs["none"] > 0 and (graph_mode == "none" or runs["full"] > 0), dict(runs)
    assert llm.kv_cache.req_to_token.eq(PAD_SLOT).all()  # every row freed and reset
