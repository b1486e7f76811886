"""Shared-prefix (cascade) decode attention against a float64 reference of plain attention over prefix + own KV.

The cache gives each group one set of prefix pages that every member's ``req_to_token`` row points at, and each
request pages of its own after them. The reference gathers each request's whole sequence through its row, so it
knows nothing of groups, splits or the index.
"""

from __future__ import annotations

import pytest
import torch
from tests.attention.kernels.kernel_reference import DEVICE, TOLERANCE, cdiv, reference_attention, rel_err

from compile_attn.attention.kernels.cascade_attention import cascade_decode_fwd, cascade_scratch
from compile_attn.attention.kernels.cascade_index import build_cascade_index, check_shared_slots


def make_shared_cache(groups, own_lens, num_kv_heads, head_dim, page_size, dtype, gen, device=DEVICE):
    """``groups``: (member batch indices, prefix length); ``own_lens[b]``: tokens request b holds after its prefix.
    Returns k/v buffers, req_to_token, rows (int32) and per-request sequence lengths."""
    bs = len(own_lens)
    prefix_of = [0] * bs
    for members, p in groups:
        for b in members:
            prefix_of[b] = p
    need = sum(cdiv(p, page_size) for _, p in groups) + sum(cdiv(n, page_size) for n in own_lens)
    num_pages = need + 2
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # page 0 holds scratch slot 0
    seq_lens = [p + n for p, n in zip(prefix_of, own_lens)]
    max_context = max(seq_lens) + 3
    rows = torch.randperm(bs + 2, generator=gen)[:bs]
    table = torch.zeros(bs + 2, max_context, dtype=torch.int32)

    def take(n):
        pages = [order.pop() for _ in range(cdiv(n, page_size))]
        return (torch.tensor(pages)[:, None] * page_size + torch.arange(page_size)).flatten()[:n]

    for members, p in groups:
        shared = take(p)
        for b in members:
            table[rows[b], :p] = shared.int()
    for b in range(bs):
        table[rows[b], prefix_of[b]:seq_lens[b]] = take(own_lens[b]).int()
    k = torch.randn(num_pages * page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_pages * page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    return k.to(device), v.to(device), table.to(device), rows.int().to(device), seq_lens


def reference(q, k, v, table, rows, seq_lens, sm_scale, logit_cap=0.0):
    out = []
    for b, n in enumerate(seq_lens):
        slots = table[int(rows[b]), :n].long()
        allowed = torch.ones(1, n, dtype=torch.bool, device=q.device)
        out.append(reference_attention(q[b:b + 1], k[slots], v[slots], allowed, sm_scale, logit_cap))
    return torch.cat(out)


def run_cascade(groups, own_lens, *, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=1,
                dtype=torch.float32, logit_cap=0.0, num_prefix_splits=None, split_levels=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k, v, table, rows, seq_lens = make_shared_cache(groups, own_lens, num_kv_heads, head_dim, page_size, dtype, gen)
    bs = len(own_lens)
    rows_cpu = rows.tolist()
    check_shared_slots(table, rows_cpu, groups)
    q = torch.randn(bs, num_q_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    index = build_cascade_index(table, rows.long(), seq, groups, req_pool_indices_cpu=rows_cpu, seq_lens_cpu=seq_lens)
    out = torch.full((bs, num_q_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    part_out = part_lse = None  # the automatic split plan (sized by the GPU's SMs) allocates its own scratch
    if num_prefix_splits is not None:
        part_out, part_lse = cascade_scratch(bs, num_q_heads, head_dim, num_prefix_splits, DEVICE)
        part_out.fill_(float("nan"))  # a partial read but never written shows as NaN
        part_lse.fill_(float("nan"))
    sm_scale = head_dim ** -0.5
    cascade_decode_fwd(q, k, v, out, index, sm_scale, logit_cap, num_prefix_splits=num_prefix_splits,
                       part_out=part_out, part_lse=part_lse, split_levels=split_levels)
    ref = reference(q, k, v, table, rows, seq_lens, sm_scale, logit_cap)
    return out, ref


@pytest.mark.parametrize("split_levels", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("prefix_len", [0, 5, 37])
def test_one_group_matches_plain_attention(page_size, prefix_len, split_levels):
    out, ref = run_cascade([([0, 1, 2], prefix_len)], [3, 1, 20], page_size=page_size, num_prefix_splits=2,
                           split_levels=split_levels)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("split_levels", [False, True])
def test_groups_in_any_order_and_requests_outside_groups(split_levels):
    # Two groups whose members are interleaved in the batch, and request 3 with no shared prefix.
    groups = [([4, 0, 2], 33), ([1, 5], 18)]
    out, ref = run_cascade(groups, [2, 7, 1, 12, 40, 3], page_size=4, num_prefix_splits=3, split_levels=split_levels)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (8, 2), (6, 1)])
def test_gqa_groups_and_head_blocks(num_q_heads, num_kv_heads):
    # 8 / 2: four query heads per KV head; 6 / 1: a group of six (rows of one request span a query block edge).
    for split_levels in (False, True):
        out, ref = run_cascade([([0, 1, 2, 3], 21)], [4, 9, 1, 2], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                               split_levels=split_levels)
        assert rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("split_levels", [False, True])
def test_bf16_with_softcap_and_one_split(split_levels):
    out, ref = run_cascade([([0, 1, 2], 40)], [3, 17, 5], dtype=torch.bfloat16, logit_cap=2.0, num_prefix_splits=1,
                           page_size=4, split_levels=split_levels)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


def test_head_dim_padded_to_a_power_of_two():
    out, ref = run_cascade([([1, 2], 35)], [2, 3, 4], head_dim=96, num_prefix_splits=2)
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


def test_no_groups_is_plain_decode():
    out, ref = run_cascade([], [5, 1, 9])
    assert rel_err(out, ref) < TOLERANCE[torch.float32]


def test_bad_groups_are_refused():
    gen = torch.Generator().manual_seed(1)
    k, v, table, rows, seq_lens = make_shared_cache([([0, 1], 8)], [2, 2], 1, 64, 1, torch.float32, gen)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    build = lambda groups: build_cascade_index(table, rows.long(), seq, groups,  # noqa: E731
                                               req_pool_indices_cpu=rows.tolist(), seq_lens_cpu=seq_lens)
    with pytest.raises(ValueError, match="two shared-prefix groups"):
        build([([0, 1], 8), ([1], 4)])
    with pytest.raises(ValueError, match="not longer than the prefix"):
        build([([0, 1], 10)])
    with pytest.raises(ValueError, match="outside the batch"):
        build([([0, 2], 4)])
    with pytest.raises(ValueError, match="does not hold the group's prefix slots"):
        table[int(rows[1]), 3] += 1
        check_shared_slots(table, rows.tolist(), [([0, 1], 8)])


@pytest.mark.gpu
@pytest.mark.parametrize("split_levels", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16])
def test_cascade_realistic_sizes_bf16(head_dim, page_size, split_levels):
    # 32 requests sharing 1,000 prefix tokens (not a multiple of any tile) with 1..300 own tokens, plus two groups.
    own = [1 + (37 * b) % 300 for b in range(64)]
    groups = [(list(range(0, 64, 2)), 1000 // page_size * page_size), ([1, 3, 5, 7], 96), ([9, 11], 0)]
    out, ref = run_cascade(groups, own, num_q_heads=32, num_kv_heads=8, head_dim=head_dim, page_size=page_size,
                           dtype=torch.bfloat16, split_levels=split_levels)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_cascade_levels_on_two_streams_in_a_cuda_graph():
    # Level 1 on a side stream next to level 2, captured in a graph and replayed over new queries.
    gen = torch.Generator().manual_seed(5)
    groups = [(list(range(48)), 2048)]
    own = [128] * 48
    k, v, table, rows, seq_lens = make_shared_cache(groups, own, 8, 64, 1, torch.bfloat16, gen)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    index = build_cascade_index(table, rows.long(), seq, groups, req_pool_indices_cpu=rows.tolist(),
                                seq_lens_cpu=seq_lens)
    q = torch.randn(48, 32, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    out = torch.empty_like(q)
    part_out, part_lse = cascade_scratch(48, 32, 64, 4, DEVICE)
    side = torch.cuda.Stream()

    def run():
        cascade_decode_fwd(q, k, v, out, index, 0.125, num_prefix_splits=2, part_out=part_out, part_lse=part_lse,
                           split_levels=True, side_stream=side)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(2):
        q.copy_(torch.randn(q.shape, generator=gen).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference(q, k, v, table, rows, seq_lens, 0.125)) < TOLERANCE[torch.bfloat16]
