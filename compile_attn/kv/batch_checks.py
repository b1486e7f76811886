"""Whether a batch fits a KV cache: the checks ``ForwardBatch.check`` and ``validate`` run, as a mixin of ``KVCache``.

The engine's batches are trusted by identity with what ``alloc_extend`` returned (list comparisons, no device
access); hand-built batches are checked row by row and slot by slot against the request table. Nothing here
allocates or frees.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from compile_attn.errors import InvalidBatchError
from compile_attn.host_tensors import ragged_arange, repeat_each, to_device

if TYPE_CHECKING:
    from compile_attn.batch import ForwardBatch


class BatchChecks:
    """Part of ``KVCache`` (its own fields, declared here): ``_issued`` (recent ``alloc_extend`` results), ``_lens``
    (tokens per row), ``_generation`` (frees so far), and ``req_to_token``, ``req_to_token_pool``, ``pool``,
    ``max_context`` and ``device``."""

    _issued: deque[tuple[weakref.ref, list[int], list[int], list[int]]]
    _lens: dict[int, int]
    _generation: int

    def issued(self, out_cache_loc: torch.Tensor, rows: list[int], prefix_lens: list[int],
               extend_lens: list[int]) -> bool:
        """True if ``out_cache_loc`` is the very tensor a recent ``alloc_extend(rows, extend_lens)`` returned, with
        ``prefix_lens`` the rows' lengths before it, and no request was freed since: such a batch is valid by
        construction. List comparisons only (no device access): the engine's steps take this path."""
        for ref, r, starts, lens in reversed(self._issued):
            if ref() is out_cache_loc:
                return r == rows and lens == extend_lens and starts == prefix_lens
        return False

    def check_rows(self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None:
        """InvalidBatchError unless every row is an allocated request row, no row appears twice, and each request's
        ``prefix_len + extend_len`` positions are allocated (so every slot it reads or writes is its own)."""
        lens = self._lens
        for b, (row, prefix, ext) in enumerate(zip(rows, prefix_lens, extend_lens)):
            have = lens.get(row)
            if have is None:
                raise InvalidBatchError(
                    f"request {b}: req_pool_indices value {row} is not an allocated request row (the table has rows "
                    f"1..{self.req_to_token_pool.num_rows - 1}, {len(lens)} of them allocated); use rows from "
                    f"kv.alloc_request()"
                )
            if prefix + ext > have:
                raise InvalidBatchError(
                    f"request {b} (row {row}): prefix_len {prefix} + extend_len {ext} = {prefix + ext} tokens but "
                    f"the row has {have} allocated; call kv.alloc_extend([row], [extend_len]) for the new tokens "
                    f"first, and pass the cached length as its prefix_len"
                )
        if len(set(rows)) != len(rows):
            seen: set[int] = set()
            twice = next(r for r in rows if r in seen or seen.add(r))  # type: ignore[func-returns-value]
            raise InvalidBatchError(f"request row {twice} appears twice in one batch (req_pool_indices {list(rows)}); "
                                    f"give each request its own row")

    def check_slots(self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int],
                    out_cache_loc: torch.Tensor) -> None:
        """InvalidBatchError unless each new token's ``out_cache_loc`` entry is the slot its request's row holds
        for that position (what ``alloc_extend`` returned), so a step writes only its own tokens' KV. Run after
        ``check_rows``. Reads the request table: on a GPU a device sync (hand-built batches only)."""
        n = sum(extend_lens)
        if out_cache_loc.device.type != self.req_to_token.device.type:
            raise InvalidBatchError(
                f"out_cache_loc is on {out_cache_loc.device} but the KV cache is on {self.device}; build the batch "
                f"with ForwardBatch.build(..., device=kv.device)"
            )
        if not n:
            return
        token_rows, positions = to_device(
            [repeat_each(rows, extend_lens), ragged_arange(prefix_lens, extend_lens)], torch.int64,
            self.req_to_token.device)
        expected = self.req_to_token[token_rows, positions].to(out_cache_loc.dtype)
        given = out_cache_loc[:n]
        if torch.equal(given, expected):
            return
        i = int((given != expected).nonzero()[0, 0])
        slot, want = int(given[i]), int(expected[i])
        where = "" if 0 <= slot < self.pool.num_slots else f", outside the KV pool's slots 0..{self.pool.num_slots - 1}"
        raise InvalidBatchError(
            f"out_cache_loc[{i}] is slot {slot}{where}, but token {i} (request row {int(token_rows[i])}, position "
            f"{int(positions[i])}) has slot {want}; use the out_cache_loc that kv.alloc_extend() returned"
        )

    def check_batch_bounds(self, fb: ForwardBatch, seq_lens: list[int]) -> None:
        """InvalidBatchError unless ``fb``'s slots, rows and sequence lengths (``seq_lens``, host values) fit this
        cache, its live requests' rows and slots checked as ``check_rows`` and ``check_slots`` do. Reads device
        tensors: ``ForwardBatch.validate`` runs it (tests, debugging)."""
        if fb.num_tokens:
            lo, hi = (int(x) for x in torch.aminmax(fb.out_cache_loc))
            if lo < 0 or hi >= self.pool.num_slots:
                raise InvalidBatchError(
                    f"out_cache_loc holds slots in [{lo}, {hi}] but the KV pool has slots "
                    f"0..{self.pool.num_slots - 1}; use the slots kv.alloc_extend() returns"
                )
        if fb.batch_size:
            rows = [int(x) for x in fb.req_pool_indices.tolist()]
            lo, hi = min(rows), max(rows)
            if lo < 0 or hi >= self.req_to_token_pool.num_rows:
                raise InvalidBatchError(
                    f"req_pool_indices in [{lo}, {hi}] but the request table has rows "
                    f"0..{self.req_to_token_pool.num_rows - 1}"
                )
            longest = max(seq_lens)
            if longest > self.max_context:
                raise InvalidBatchError(
                    f"seq_len {longest} exceeds the KV cache's max_context {self.max_context}; "
                    f"create the KVCache with a larger max_context"
                )
            # Padded requests of a graph view (after real_batch_size) share row PAD_REQUEST and its scratch slot.
            real = fb.batch_size if fb.graph_bucket is None else fb.real_batch_size
            prefix, extend = fb.extend_prefix_lens_cpu[:real], fb.extend_seq_lens_cpu[:real]
            self.check_rows(rows[:real], prefix, extend)
            self.check_slots(rows[:real], prefix, extend, fb.out_cache_loc)  # padding tokens write PAD_SLOT

    @property
    def generation(self) -> int:
        """Counts frees: a batch checked against the cache stays valid until a row's slots can change hands."""
        return self._generation
