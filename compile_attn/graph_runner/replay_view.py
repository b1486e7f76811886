"""Padding a live batch into the static buffers and building the replay view a graph runs on.

Decode batches are padded to a bucket of requests: padded requests use row ``PAD_REQUEST`` with the
backend's seq_len fill value and write their token's KV to ``PAD_SLOT``. Extend batches are padded to
a bucket of tokens: the extra tokens belong to no request, sit at position 0 and write to
``PAD_SLOT``. A chain verify batch of Q tokens per request (``verify_view``) is padded to a bucket of requests as
decode is, each padded request with Q tokens at position 0 writing to ``PAD_SLOT``. Either way padding never touches
a live request's KV. Only entries that may hold stale
live values are re-padded, so a steady decode loop copies the live fields and little else.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from compile_attn.batch import ForwardBatch
from compile_attn.graph_runner.static_buffers import StaticBuffers
from compile_attn.batch import PAD_REQUEST, PAD_SLOT
from compile_attn.graph_runner.step_kernels import TokenFeed, copy_decode_inputs


def next_bucket(buckets: Sequence[int], n: int) -> int | None:
    """Smallest bucket ``>= n`` in the sorted ``buckets``; None when ``n`` is larger than all of them."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


class ReplayViews:
    """Copies live batches into ``StaticBuffers`` and returns padded views of them.

    Invariants kept between calls: token entries from ``_tokens_dirty`` on hold padding values;
    request entries from ``_requests_dirty`` on hold decode padding (row PAD_REQUEST, seq_len fill);
    ``extend_seq_lens``/``extend_start_loc`` entries from ``_extend_dirty`` on hold the decode
    layout (1 and ``arange``).
    """

    def __init__(self, buffers: StaticBuffers, seq_len_fill: int) -> None:
        self.buffers = buffers
        self.seq_len_fill = seq_len_fill
        self.pad_prefix = max(seq_len_fill - 1, 0)
        self._copy_targets: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.mark_all_dirty()

    def mark_all_dirty(self) -> None:
        """Forget the invariants (after capture wrote dummy batches into the buffers)."""
        self._tokens_dirty = self.buffers.max_num_tokens
        self._requests_dirty = self.buffers.max_batch_size
        self._extend_dirty = self.buffers.max_batch_size

    # ------------------------------------------------------------------ int64 fields
    def _targets(self, bs: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The copies' destinations for ``bs`` requests and ``n`` tokens: (the int64 fields, the int32 request
        fields). Decode shapes (``n == bs``, at most ``max_batch_size`` of them) keep theirs: slicing them
        anew every step is host time on the step's critical path. Extend shapes (any token count) are sliced
        per step, not kept, so a long-running server's mix of prompt lengths does not grow a cache."""
        targets = self._copy_targets.get((bs, n))
        if targets is None:
            b = self.buffers
            targets = (
                [b.input_ids[:n], b.positions[:n], b.out_cache_loc[:n], b.req_pool_indices[:bs]],
                [b.seq_lens[:bs], b.extend_prefix_lens[:bs], b.extend_seq_lens[:bs], b.extend_start_loc[:bs]],
            )
            if n == bs:
                self._copy_targets[(bs, n)] = targets
        return targets

    def _copy_int64_fields(self, fb: ForwardBatch, n: int, targets: list[torch.Tensor]) -> None:
        """The ``n`` token fields and the request rows into ``targets``, in one ``_foreach_copy_`` (a single kernel
        on a GPU: each launch costs the host time on the critical path of a graph step); re-pads stale token
        entries."""
        torch._foreach_copy_(targets, [fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices])
        self._repad_tokens(n)

    def _repad_tokens(self, n: int) -> None:
        """Padding values in the token entries from ``n`` on that may hold a live batch's."""
        b = self.buffers
        if self._tokens_dirty > n:
            pad = slice(n, self._tokens_dirty)
            b.input_ids[pad].zero_()
            b.positions[pad].zero_()
            b.out_cache_loc[pad].fill_(PAD_SLOT)
        self._tokens_dirty = n

    def _pad_requests(self, bs: int) -> None:
        """Decode padding (row PAD_REQUEST, the seq_len fill value) in the request entries from ``bs`` on that may
        hold a live batch's."""
        b = self.buffers
        if self._requests_dirty > bs:
            pad = slice(bs, self._requests_dirty)
            b.req_pool_indices[pad].fill_(PAD_REQUEST)
            b.seq_lens[pad].fill_(self.seq_len_fill)
            b.extend_prefix_lens[pad].fill_(self.pad_prefix)
        self._requests_dirty = bs

    def _padded_seq_lens_cpu(self, fb: ForwardBatch, npad: int) -> torch.Tensor:
        """``fb``'s host sequence lengths with ``npad`` padded requests' after them."""
        if not npad:
            return fb.seq_lens_cpu
        return torch.cat([fb.seq_lens_cpu, torch.full((npad,), self.seq_len_fill, dtype=fb.seq_lens_cpu.dtype)])

    # ------------------------------------------------------------------ views
    def decode_view(self, fb: ForwardBatch, bucket: int, feed: TokenFeed | None = None,
                    table: torch.Tensor | None = None) -> ForwardBatch:
        """``fb`` (DECODE, ``batch_size <= bucket``) padded with requests up to ``bucket``; its live fields go in
        one kernel where it can (``copy_decode_inputs``), the placeholders of its input ids replaced by ``feed``,
        and with ``table`` (the KV cache's request table) each request's new slot written into it."""
        b, bs = self.buffers, fb.batch_size
        int64_targets, int32_targets = self._targets(bs, bs)
        copy_decode_inputs(int64_targets + int32_targets[:2], [fb.input_ids, fb.positions, fb.out_cache_loc,
                           fb.req_pool_indices, fb.seq_lens, fb.extend_prefix_lens], feed, table)
        self._repad_tokens(bs)
        self._pad_requests(bs)
        if self._extend_dirty:
            b.extend_seq_lens[: self._extend_dirty].fill_(1)
            b.extend_start_loc[: self._extend_dirty].copy_(
                torch.arange(self._extend_dirty, dtype=torch.int32, device=b.device)
            )
            self._extend_dirty = 0
        npad = bucket - bs
        seq_lens_cpu = self._padded_seq_lens_cpu(fb, npad)
        return b.view(
            forward_mode=fb.forward_mode,
            batch_size=bucket,
            num_tokens=bucket,
            seq_lens_cpu=seq_lens_cpu,
            extend_prefix_lens_cpu=list(fb.extend_prefix_lens_cpu) + [self.pad_prefix] * npad,
            extend_seq_lens_cpu=list(fb.extend_seq_lens_cpu) + [1] * npad,
            real_batch_size=bs,
            bucket=bucket,
            seq_lens_sum=fb.seq_lens_sum + npad * self.seq_len_fill,
        )

    def extend_view(self, fb: ForwardBatch, bucket: int) -> ForwardBatch:
        """``fb`` (EXTEND/MIXED/TARGET_VERIFY, ``num_tokens <= bucket``) with trailing padding tokens up to
        ``bucket``; a verification step's draft trees go with it (the padding tokens belong to no request)."""
        b, bs, n = self.buffers, fb.batch_size, fb.num_tokens
        int64_targets, int32_targets = self._targets(bs, n)
        self._copy_int64_fields(fb, n, int64_targets)
        torch._foreach_copy_(int32_targets, [fb.seq_lens, fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start_loc])
        self._requests_dirty = max(self._requests_dirty, bs)
        self._extend_dirty = max(self._extend_dirty, bs)
        view = b.view(
            forward_mode=fb.forward_mode,
            batch_size=bs,
            num_tokens=bucket,
            seq_lens_cpu=fb.seq_lens_cpu,
            extend_prefix_lens_cpu=list(fb.extend_prefix_lens_cpu),
            extend_seq_lens_cpu=list(fb.extend_seq_lens_cpu),
            real_batch_size=bs,
            bucket=bucket,
            seq_lens_sum=fb.seq_lens_sum,
        )
        view.draft_parents = fb.draft_parents
        view.req_pool_indices_cpu = fb.req_pool_indices_cpu  # host rows (the fp8 scale calibration reads them)
        return view

    def verify_view(self, fb: ForwardBatch, bucket: int, tokens_per_request: int,
                    end_aligned: tuple[torch.Tensor, list[torch.Tensor], list[int]] | None = None) -> ForwardBatch:
        """``fb`` (a chain verify batch of ``tokens_per_request`` tokens per request, ``batch_size <= bucket``) padded
        with requests up to ``bucket`` (``bucket x Q`` tokens): padded requests hold decode padding (row PAD_REQUEST,
        the seq_len fill value), their tokens the token padding (id and position 0, slot PAD_SLOT).

        ``end_aligned``: ``fb``'s requests verify fewer than Q tokens each (graph_runner/verify_layout.py): the
        device rows of its tokens in the B x Q layout, the view's int32 request fields (prefix ``seq_len - Q``,
        extend Q, start ``b x Q``) and its host prefix lengths; the other rows hold token padding."""
        b, bs, q = self.buffers, fb.batch_size, tokens_per_request
        n = bs * q
        int64_targets, int32_targets = self._targets(bs, n)
        if end_aligned is None:
            self._copy_int64_fields(fb, n, int64_targets)
            int32_fields = [fb.seq_lens, fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start_loc]
        else:
            rows, (prefix, extend, start), _ = end_aligned
            self._tokens_dirty = max(self._tokens_dirty, n)
            self._repad_tokens(0)  # the filler rows: token padding
            for name in ("input_ids", "positions", "out_cache_loc"):
                getattr(b, name).index_copy_(0, rows, getattr(fb, name))
            b.req_pool_indices[:bs].copy_(fb.req_pool_indices)
            self._tokens_dirty = n
            int32_fields = [fb.seq_lens, prefix, extend, start]
        torch._foreach_copy_(int32_targets, int32_fields)
        self._pad_requests(bs)
        self._extend_dirty = max(self._extend_dirty, bs)
        npad = bucket - bs
        seq_lens_cpu = self._padded_seq_lens_cpu(fb, npad)
        view = b.view(
            forward_mode=fb.forward_mode,
            batch_size=bucket,
            num_tokens=bucket * q,
            seq_lens_cpu=seq_lens_cpu,
            extend_prefix_lens_cpu=list(fb.extend_prefix_lens_cpu if end_aligned is None else end_aligned[2])
            + [self.pad_prefix] * npad,
            extend_seq_lens_cpu=[q] * bucket,
            real_batch_size=bs,
            bucket=bucket * q,
            seq_lens_sum=fb.seq_lens_sum + npad * self.seq_len_fill,
        )
        view.req_pool_indices_cpu = fb.req_pool_indices_cpu
        return view
