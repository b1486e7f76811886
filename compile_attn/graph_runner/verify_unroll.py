"""A chain verify step as a decode step: how verification runs inside the full decode graphs.

In a verify batch whose drafts form chains (``ForwardMode.TARGET_VERIFY`` without ``draft_parents``), token j of
request b sits at position ``prefix_b + j`` and attends to positions ``0 .. prefix_b + j`` of its request's row: the
causal rule. That is exactly what a decode row on the same request-table row with ``seq_len = prefix_b + j + 1``
computes, once its new K/V is stored. So the runner replays such a batch through the full decode graph of its token
count (``unroll_chain_verify`` gives the decode-shaped twin: request rows repeated, seq_lens = positions + 1, the
same tokens, positions and slots): no graph of its own to capture, every backend with full decode graphs serves it,
and the metadata goes through the three-method contract like any decode step's. The cost is that a request's
prefix is read once per verified token instead of once per request (see docs/speculative.md). Trees (a mask,
not a range) take the extend route, and so do chains on a backend whose decode kernel stores each row's new token
itself (``AttentionBackend.decode_stores_kv_first`` False: triton's fused store, where one row could read another's
slot before it is written) until ``store_decode_kv_first()``, which the engine calls when speculation is on.
"""

from __future__ import annotations

import torch

from compile_attn.batch import ForwardBatch, ForwardMode
from compile_attn.host_tensors import int_tensor


def is_chain_verify(fb: ForwardBatch) -> bool:
    """Whether ``fb`` is a verify batch whose tokens form chains (no tree)."""
    return fb.forward_mode.is_verify() and fb.draft_parents is None


def unroll_chain_verify(fb: ForwardBatch) -> ForwardBatch:
    """The DECODE batch of ``fb``'s tokens: one row per token on its request's table row, ``seq_len`` its position
    + 1. The device fields come from ``fb``'s by three device ops (no upload, no sync); host fields from its lists.
    Only a graph runner's decode view reads it (its rows repeat, which ``ForwardBatch.check`` refuses)."""
    n = fb.num_tokens
    rows = fb.req_pool_indices_cpu if fb.req_pool_indices_cpu is not None else fb.req_pool_indices.tolist()
    rows_cpu, seq_cpu = [], []
    for row, prefix, length in zip(rows, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
        rows_cpu += [row] * length
        seq_cpu += range(prefix + 1, prefix + length + 1)
    seq_lens = (fb.positions + 1).to(torch.int32)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=n,
        input_ids=fb.input_ids,
        positions=fb.positions,
        req_pool_indices=torch.repeat_interleave(fb.req_pool_indices, fb.extend_seq_lens, output_size=n),
        seq_lens=seq_lens,
        seq_lens_cpu=int_tensor(seq_cpu),
        out_cache_loc=fb.out_cache_loc,
        seq_lens_sum=sum(seq_cpu),
        extend_prefix_lens=seq_lens - 1,
        extend_seq_lens=torch.ones(n, dtype=torch.int32, device=fb.device),
        extend_start_loc=torch.arange(n, dtype=torch.int32, device=fb.device),
        extend_prefix_lens_cpu=[s - 1 for s in seq_cpu],
        extend_seq_lens_cpu=[1] * n,
        req_pool_indices_cpu=rows_cpu,
    )
