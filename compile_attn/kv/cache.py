"""KVCache: the request table, the per-layer K/V pool and the page allocator tied together, with each request row's
pages on the host.

Slots are token-level: token ``i`` of a request lives at slot ``page * page_size + i % page_size`` of
the page holding it. Page 0 and request row 0 are reserved scratch: padded tokens write to slot
``PAD_SLOT`` and padded requests use row ``PAD_REQUEST`` (all of whose entries point at the scratch
slot), so padding never touches a live request's KV. Allocation is all-or-nothing: when it cannot be
satisfied, a KVCacheExhaustedError is raised and nothing changed. The cache also answers whether a batch
fits it (``issued``, ``check_rows``, ``check_slots``, from ``kv/batch_checks.py``: see ``ForwardBatch.check``). The row
bookkeeping (``_pages``, ``_lens``, ``_issued``, ``_generation``) is this class's own: its neighbours in ``kv/`` read
and change it through the methods under "rows". Index formats built from the request table live with the backends
that read them (``attention/kernels/kv_index.py``).
"""

from __future__ import annotations

import array
import logging
import weakref
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from compile_attn.arg_checks import kv_dtype, positive_int, renamed_keywords
from compile_attn.batch import PAD_SLOT
from compile_attn.errors import InvalidBatchError, KVCacheExhaustedError
from compile_attn.host_tensors import int_tensor, ragged_arange, repeat_each, to_device_groups
from compile_attn.kv.batch_checks import BatchChecks
from compile_attn.kv.allocator import PageAllocator
from compile_attn.kv.kv_scales import FirstPrefillCalibration
from compile_attn.kv.pools import PagedKVPool, ReqToTokenPool

from compile_attn.kv.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from compile_attn.layer import AttentionLayer

logger = logging.getLogger(__name__)

KV_CACHE_RENAMED = {"max_requests": "max_batch_size", "num_tokens": "kv_cache_tokens"}  # KVCache's former keywords


def _slots_of(pages: array.array, start: int, n: int, page_size: int) -> array.array:
    """Slots of positions ``start .. start + n - 1`` of a request holding ``pages``: one run per page."""
    if page_size == 1:
        return pages[start:start + n]
    out = array.array("q")
    pos, end = start, start + n
    while pos < end:
        page, offset = divmod(pos, page_size)
        take = min(page_size - offset, end - pos)
        first = pages[page] * page_size + offset
        out.extend(range(first, first + take))
        pos += take
    return out


class KVCache(BatchChecks):
    """Request table + paged K/V pool + page allocator, with per-request page bookkeeping on the host."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None = None,
        max_batch_size: int | None = None,
        max_context: int,
        kv_cache_tokens: int | None = None,
        page_size: int = 1,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
        **deprecated: Any,
    ) -> None:
        """``max_batch_size`` request rows (live requests at once); ``kv_cache_tokens`` is the KV capacity (rounded
        up to whole pages), scratch page excluded. Sizes must be positive ints and ``dtype`` one of
        ``arg_checks.KV_DTYPES``; anything else raises InvalidConfigError. The former names ``max_requests`` and
        ``num_tokens`` still work, with a DeprecationWarning."""
        renamed = renamed_keywords("KVCache", deprecated, KV_CACHE_RENAMED)
        max_batch_size = renamed.get("max_batch_size", max_batch_size)
        kv_cache_tokens = renamed.get("kv_cache_tokens", kv_cache_tokens)
        page_size = positive_int("KVCache", "page_size", page_size)
        kv_cache_tokens = positive_int("KVCache", "kv_cache_tokens (the KV capacity in tokens)", kv_cache_tokens)
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("max_batch_size", max_batch_size), ("max_context", max_context)):
            positive_int("KVCache", name, value)
        if v_head_dim is not None:
            positive_int("KVCache", "v_head_dim", v_head_dim)
        kv_dtype("KVCache", dtype)
        num_pages = -(-kv_cache_tokens // page_size)
        self.page_size = page_size
        self.max_context = max_context
        self.device = torch.device(device)
        self.req_to_token_pool = ReqToTokenPool(max_batch_size, max_context, device)
        self.pool = PagedKVPool(
            num_pages=num_pages, page_size=page_size, num_layers=num_layers, num_kv_heads=num_kv_heads,
            head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype, device=device,
        )
        if self.pool.quantized:  # scales that nothing gives are set by the first prefill (kv/kv_scales.py)
            self.pool.scale_calibration = FirstPrefillCalibration(self.pool)
        self.allocator = PageAllocator(num_pages)
        self._pages: dict[int, array.array] = {}  # request row -> its pages, in order (int64)
        self._lens: dict[int, int] = {}  # request row -> tokens allocated
        # What the last few alloc_extend calls returned: (out_cache_loc, rows, starts, extend_lens), see issued().
        self._issued: deque[tuple[weakref.ref, list[int], list[int], list[int]]] = deque(maxlen=4)
        self._generation = 0  # see generation
        self.prefix_cache: PrefixCache | None = None  # see enable_prefix_cache
        # Rows whose table entries were rewritten outside a step, collected while another process mirrors the table
        # (tensor parallelism: engine/tensor_parallel), which takes them with each step; None: nobody mirrors it.
        self.rewritten_rows: set[int] | None = None

    @classmethod
    def for_layers(cls, layers: Sequence[AttentionLayer], **sizes: Any) -> KVCache:
        """A cache shaped for ``layers`` (one K/V buffer per layer; KV heads and head dims of the first, which every
        layer of a model shares); ``sizes`` are the other constructor arguments."""
        first = layers[0]
        return cls(num_layers=len(layers), num_kv_heads=first.num_kv_heads, head_dim=first.head_dim,
                   v_head_dim=first.v_head_dim, **sizes)

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token

    @property
    def available_pages(self) -> int:
        """Pages an allocation can get: the free ones and those only the prefix cache holds (evicted on demand)."""
        return self.allocator.available + (self.prefix_cache.evictable_pages if self.prefix_cache else 0)

    @property
    def available_tokens(self) -> int:
        return self.available_pages * self.page_size

    def enable_prefix_cache(self, enabled: bool = True) -> None:
        """Keep computed KV in a radix tree for later requests to reuse (see prefix_cache.py): a row's first pages
        may then be borrowed from it, freeing a row returns only its own pages, and an allocation evicts pages only
        the tree holds when the free ones run short. False drops what it holds and turns it off (only while no
        request row holds pages)."""
        if enabled and self.prefix_cache is None:
            self.prefix_cache = PrefixCache(self)
        elif not enabled and self.prefix_cache is not None:
            if self._pages:
                raise ValueError(f"cannot turn the prefix cache off while {len(self._pages)} request rows hold pages")
            self.prefix_cache.clear()
            self.prefix_cache = None

    def alloc_request(self) -> int:
        """Reserve a request row; its KV grows with ``alloc_extend``."""
        (row,) = self.req_to_token_pool.alloc(1)
        self._pages[row], self._lens[row] = array.array("q"), 0
        return row

    def free_request(self, row: int) -> None:
        """Return the row and all its pages."""
        self.free_requests([row])

    def free_requests(self, rows: Sequence[int]) -> None:
        """Return the rows and all their pages, in one call each to the page allocator and the request table."""
        rows = list(rows)
        self.slots_changed()  # a freed row's slots may be handed out again: no batch is trusted from here on
        for row in rows:
            if row not in self._pages:
                raise ValueError(f"request row {row} is not allocated")
        if len(set(rows)) != len(rows):
            raise ValueError(f"cannot free request rows {rows}: a row appears twice")
        pages = array.array("q")
        cache = self.prefix_cache
        for row in rows:  # with a prefix cache, the pages a row borrowed from it stay cached
            pages.extend(self._pages[row] if cache is None else cache.release(row, self._pages[row]))
        self.allocator.free(pages)
        for row in rows:
            del self._pages[row], self._lens[row]
        self.req_to_token_pool.free(rows)

    def room_in_last_page(self, row: int) -> int:
        """Tokens request ``row`` can still add without a new page."""
        return len(self._pages[row]) * self.page_size - self._lens[row]

    def pages_needed(self, row: int, extend_len: int) -> int:
        have = len(self._pages[row])
        return max(0, -(-(self._lens[row] + extend_len) // self.page_size) - have)

    def decode_pages_needed(self, rows: Sequence[int]) -> int:
        """Pages that one more token for each of ``rows`` takes in all (``sum(pages_needed(r, 1))``, in one pass)."""
        ps, lens, pages_of = self.page_size, self._lens, self._pages
        return sum(max(0, (lens[r] + ps) // ps - len(pages_of[r])) for r in rows)

    def alloc_extend(self, rows: Sequence[int], extend_lens: Sequence[int], *,
                     defer_table_write: bool = False) -> torch.Tensor:
        """Allocate slots for ``extend_lens[i]`` new tokens of request ``rows[i]``, for the whole batch.

        Returns ``out_cache_loc`` (int64, on the cache's device, tokens request after request) and
        fills ``req_to_token``. Raises KVCacheExhaustedError with nothing changed if the pages do
        not fit, InvalidBatchError if a request would pass ``max_context``.

        ``defer_table_write``: ``out_cache_loc`` comes back as a host tensor and the table is not written; the batch
        built from it (``ForwardBatch.build(..., table_write_pending=True)``) carries the slots to the device in its
        own upload and its step writes ``req_to_token[rows[i], start_i + j] = out_cache_loc[token j of row i]``
        before the forward reads the table (``ForwardBatch.write_pending_table``, or on the way into a decode
        graph's buffers, ``step_kernels.copy_decode_inputs``): no upload and no device op here. Decode steps (one
        token per row) and speculative verify steps (1 + K tokens per row) use it.
        """
        rows, extend_lens = list(rows), list(extend_lens)
        if len(rows) != len(extend_lens):
            raise InvalidBatchError(
                f"alloc_extend needs one extend_len per request row, got {len(rows)} rows {rows} and "
                f"{len(extend_lens)} extend_lens {extend_lens}; nothing was allocated"
            )
        one_each = extend_lens.count(1) == len(extend_lens)
        if rows and one_each:
            out = self._alloc_decode(rows, defer_table_write)
            if out is not None:
                return out
        for row, n in zip(rows, extend_lens):
            if row not in self._pages:
                raise InvalidBatchError(f"request row {row} is not allocated; call alloc_request() first")
            if n < 0:
                raise InvalidBatchError(f"extend_len must be >= 0, got {n} for request row {row}")
            if self._lens[row] + n > self.max_context:
                raise InvalidBatchError(
                    f"request row {row} would grow to {self._lens[row] + n} tokens, past max_context "
                    f"{self.max_context}"
                )
        if len(set(rows)) != len(rows):
            raise InvalidBatchError(f"a request row appears twice in one allocation: {rows}")
        per_row = [self.pages_needed(r, n) for r, n in zip(rows, extend_lens)]
        needed = sum(per_row)
        if needed > self.allocator.available and self.prefix_cache is not None:
            self.prefix_cache.evict(needed - self.allocator.available)
        if needed > self.allocator.available:
            raise KVCacheExhaustedError(
                f"KV cache full: this batch needs {needed} pages ({needed * self.page_size} tokens), "
                f"{self.allocator.available} pages free; nothing was allocated. Wait for requests to "
                f"finish, preempt some, or create the cache with more tokens"
            )
        new_pages = self.allocator.alloc(needed)
        ps = self.page_size
        slots = array.array("q")
        starts: list[int] = []
        taken = 0
        for row, n, k in zip(rows, extend_lens, per_row):
            pages = self._pages[row]
            pages.extend(new_pages[taken:taken + k])
            taken += k
            start = self._lens[row]
            slots.extend(_slots_of(pages, start, n, ps))
            starts.append(start)
            self._lens[row] = start + n
        if not slots:
            return torch.empty(0, dtype=torch.int64, device="cpu" if defer_table_write else self.device)
        if defer_table_write:
            return self._deferred(slots, rows, starts, extend_lens)
        # One host-to-device copy: the slots, then each token's request row and position (expanded on the host),
        # and the table written with them on the device.
        (out, token_rows, token_positions), (slots32,) = to_device_groups([  # the table's int32 copy rides along
            ([slots, repeat_each(rows, extend_lens), ragged_arange(starts, extend_lens)], torch.int64),
            ([slots], torch.int32)], self.device)
        self.req_to_token[token_rows, token_positions] = slots32
        self._issued.append((weakref.ref(out), rows, starts, extend_lens))
        return out

    def _alloc_decode(self, rows: list[int], defer_table_write: bool = False) -> torch.Tensor | None:
        """``alloc_extend`` of one token for each of ``rows`` in comprehensions, not a loop of calls: a decode
        step of hundreds of requests runs it every step. None (nothing changed) when a check fails or the
        bookkeeping is not the usual "pages cover exactly the tokens"; the general path then does the work or
        raises the error."""
        lens, ps = self._lens, self.page_size
        try:
            starts = [lens[r] for r in rows]
            page_lists = [self._pages[r] for r in rows]
        except KeyError:
            return None
        if max(starts) >= self.max_context or len(set(rows)) != len(rows):
            return None
        deficit = [s - len(pages) * ps for pages, s in zip(page_lists, starts)]  # >= 0: its pages are full
        if max(deficit) >= ps:
            return None
        grow = [pages for pages, d in zip(page_lists, deficit) if d >= 0]
        if len(grow) > self.allocator.available:
            return None
        for pages, page in zip(grow, self.allocator.alloc(len(grow))):
            pages.append(page)
        if ps == 1:
            slots = [pages[s] for pages, s in zip(page_lists, starts)]
        else:
            slots = [pages[s // ps] * ps + s % ps for pages, s in zip(page_lists, starts)]
        lens.update(zip(rows, [s + 1 for s in starts]))
        if defer_table_write:
            return self._deferred(slots, rows, starts, [1] * len(rows))
        # one token per request: nothing to expand on the device
        (out, rows_t, starts_t), (slots32,) = to_device_groups([([slots, rows, starts], torch.int64),
                                                                 ([slots], torch.int32)], self.device)
        self.req_to_token[rows_t, starts_t] = slots32
        self._issued.append((weakref.ref(out), rows, starts, [1] * len(rows)))
        return out

    def _deferred(self, slots: Sequence[int], rows: list[int], starts: list[int],
                  extend_lens: list[int]) -> torch.Tensor:
        """The host ``out_cache_loc`` of an allocation whose table write is left to its step."""
        out = int_tensor(slots)
        self._issued.append((weakref.ref(out), rows, starts, extend_lens))
        return out

    def truncate(self, row: int, length: int) -> None:
        """Cut request ``row`` back to its first ``length`` tokens (undoing an allocation whose step failed): pages
        past them go back to the allocator and the table's entries past them point at the scratch slot again. A
        row that holds exactly ``length`` tokens is left as it is."""
        old = self._cut_row(row, length)
        if old == length:  # nothing to undo: no slot changes hands, issued batches stay trusted
            return
        self.req_to_token[row, length:old].fill_(PAD_SLOT)
        self.slots_changed()  # as in free_requests: slots change hands, no issued batch is trusted any more

    def truncate_rows(self, rows: Sequence[int], lengths: Sequence[int]) -> None:
        """``truncate`` of each of ``rows`` to its length in ``lengths``, the table's entries reset in one device op
        for all of them (a speculative step cuts back every request's rejected drafts)."""
        cut_rows, starts, counts, freed = [], [], [], array.array("q")
        try:
            for row, length in zip(list(rows), list(lengths)):
                old = self._cut_row(row, length, freed)
                if old != length:
                    cut_rows.append(row)
                    starts.append(length)
                    counts.append(old - length)
        finally:  # the rows cut before a bad one keep their cut: their pages go back either way
            self.allocator.free(freed)  # one call for every row (its checks scan the whole pool once)
        if not cut_rows:
            return
        table_rows, positions = to_device_groups(
            [([repeat_each(cut_rows, counts), ragged_arange(starts, counts)], torch.int64)], self.device)[0]
        self.req_to_token[table_rows, positions] = PAD_SLOT
        self.slots_changed()

    def _cut_row(self, row: int, length: int, freed: array.array | None = None) -> int:
        """The host side of ``truncate``: row ``row`` keeps its first ``length`` tokens and the pages holding them,
        the pages past them go back to the allocator (or onto ``freed``, for the caller to free); returns the tokens
        it held before. The caller resets the table's entries past ``length`` and calls ``slots_changed`` when
        anything was cut."""
        if row not in self._pages:
            raise ValueError(f"request row {row} is not allocated")
        old = self._lens[row]
        if not 0 <= length <= old:
            raise ValueError(f"cannot truncate request row {row} to {length} tokens: it holds {old}")
        if length < old:
            keep = -(-length // self.page_size)
            pages = self._pages[row]
            if freed is None:
                self.allocator.free(pages[keep:])
            else:
                freed.extend(pages[keep:])
            del pages[keep:]
            self._lens[row] = length
        return old

    # ------------------------------------------------------------------ rows: for the prefix cache and the finders
    def row_pages(self, row: int) -> array.array | None:
        """The pages request ``row`` holds, in order (the live list: change it only through ``start_row`` and
        ``replace_pages``), or None for a row that is not allocated."""
        return self._pages.get(row)

    def row_len(self, row: int) -> int:
        """Tokens allocated to request ``row``."""
        return self._lens[row]

    def held_rows(self) -> list[tuple[int, array.array, int]]:
        """``(row, pages, tokens)`` of every allocated request row."""
        return [(row, pages, self._lens[row]) for row, pages in self._pages.items()]

    def start_row(self, row: int, pages: Sequence[int], num_tokens: int) -> None:
        """Give the freshly allocated ``row`` the ``pages`` that hold its first ``num_tokens`` tokens (a cached
        prefix; the caller writes the table); ValueError for a row that already holds tokens or pages."""
        if self._lens[row] or len(self._pages[row]):
            raise ValueError(f"request row {row} already holds {self._lens[row]} tokens; attach a prefix to a new row")
        self._pages[row] = array.array("q", pages)
        self._lens[row] = num_tokens

    def replace_pages(self, row: int, indices: Sequence[int], pages: Sequence[int]) -> None:
        """Row ``row``'s pages at ``indices`` become ``pages`` (the same KV held elsewhere; the caller frees the
        old pages and writes the table)."""
        own = self._pages[row]
        for i, page in zip(indices, pages):
            own[i] = page

    def rows_rewritten(self, rows: Sequence[int]) -> None:
        """The table entries of ``rows`` were rewritten outside a step (the prefix cache lent or swapped pages): no
        batch issued before is trusted, and a mirror of the table is told (``rewritten_rows``)."""
        self.slots_changed()
        if self.rewritten_rows is not None:
            self.rewritten_rows.update(rows)

    def slots_changed(self) -> None:
        """A row's slots changed hands (a free, a truncation, a table rewrite): no batch issued before is trusted."""
        self._issued.clear()
        self._generation += 1
