"""ForwardBatch: one step's batch, with its host and device views.

A batch is a list of requests; request b contributes ``extend_seq_lens[b]`` new tokens at positions
``extend_prefix_lens[b] .. seq_lens[b] - 1`` (decode is the case where every request adds one token).
Tokens are laid out request after request. A batch padded for a CUDA graph bucket may carry padding
tokens after the last request's tokens; they belong to no request and write KV only to the scratch slot.
This module builds and checks batches; it never allocates KV slots (see ``kv/cache.py``) and imports nothing of the
KV cache: what it asks of one is ``BatchCache``.

Where a batch is checked: ``build`` checks what its host lists say (lengths agree, nothing negative, the token
count); ``check(kv_cache)``, run by every backend's eager ``init_forward_metadata``, checks the batch against the
cache (rows, allocated lengths, slots) with host values, a few list comparisons for the engine's batches (their
slots come from ``kv_cache.alloc_extend``); ``validate`` also reads device tensors (tests, debugging).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol

import torch

from compile_attn.batch.mode import PAD_REQUEST, PAD_SLOT, ForwardMode, SharedPrefixGroup
from compile_attn.draft_tree import check_draft_parents, tree_positions
from compile_attn.errors import InvalidBatchError
from compile_attn.host_tensors import (int_list, int_tensor, num_entries, ragged_arange, repeat_each, short_list,
                                      to_device_groups)


class BatchCache(Protocol):
    """What a batch asks of the KV cache it runs on: ``kv.cache.KVCache``, whose checks are ``kv/batch_checks``."""

    @property
    def req_to_token(self) -> torch.Tensor: ...
    @property
    def generation(self) -> int: ...
    def issued(self, out_cache_loc: torch.Tensor, rows: list[int], prefix_lens: list[int],
               extend_lens: list[int]) -> bool: ...
    def check_rows(self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None: ...
    def check_slots(self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int],
                    out_cache_loc: torch.Tensor) -> None: ...
    def check_batch_bounds(self, fb: ForwardBatch, seq_lens: list[int]) -> None: ...


@dataclass
class ForwardBatch:
    """One forward step.

    Device tensors: ``input_ids``, ``positions``, ``out_cache_loc`` (length = num_tokens), and per
    request ``req_pool_indices``, ``seq_lens``, ``extend_prefix_lens``, ``extend_seq_lens``,
    ``extend_start_loc``. Host views: ``seq_lens_cpu`` and the ``*_cpu`` lists, so backends can plan
    without a device sync. ``graph_bucket`` is set when the tensors are views of a graph runner's
    static buffers padded to that bucket; ``real_batch_size`` is then the number of live requests.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_sum: int
    extend_prefix_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    real_batch_size: int | None = None
    graph_bucket: int | None = None
    req_pool_indices_cpu: list[int] | None = None  # host copy of req_pool_indices (set by build)
    # Decode requests that share a cached prefix (SharedPrefixGroup); None: not known, a backend may
    # find them itself. Read by the triton backend's shared-prefix (cascade) decode.
    shared_prefix: tuple[SharedPrefixGroup, ...] | None = None
    # TARGET_VERIFY: per request, the parent (index among its new tokens) of each new token, -1 for token 0; new
    # token i sees the cached prefix, its ancestors and itself (compile_attn/draft_tree.py). None: chains.
    draft_parents: tuple[tuple[int, ...], ...] | None = None
    # The request table does not hold this batch's new slots yet: whoever runs the batch writes token t's slot
    # out_cache_loc[t] at its request's row and table position (prefix + its index among the request's new tokens)
    # on the device before the forward reads the table (write_pending_table; a decode graph's input copy does it on
    # the way). With one new token per request token b is request b's and its position positions[b]. Set by
    # build(..., table_write_pending=True) for slots from kv.alloc_extend(..., defer_table_write=True).
    table_write_pending: bool = False
    # The per-token fields (input_ids, positions, out_cache_loc) as build was given them when all three were host
    # values, else None: what a tensor-parallel step message sends without reading the device.
    host_tokens: tuple[object, object, object] | None = field(default=None, repr=False, compare=False)
    # Set by build (whose host and device views agree by construction); a batch assembled field by field, or
    # changed with dataclasses.replace, is checked in full (see check()).
    _built: bool = field(default=False, init=False, repr=False, compare=False)
    _scratch: bool = field(default=False, init=False, repr=False, compare=False)  # see build_scratch
    _checked_against: tuple[BatchCache, torch.Tensor, int] | None = field(default=None, init=False, repr=False,
                                                                       compare=False)
    # The out_cache_loc tensor build was given (kv.issued recognises it; on a GPU a host one is uploaded).
    _given_loc: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    # A pending table write of several new tokens per request: each token's table row and position on the device
    # (uploaded by build with the other fields); None for one token per request (req_pool_indices and positions).
    _table_index: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False,
                                                                   compare=False)

    def __post_init__(self) -> None:
        if self.real_batch_size is None:
            self.real_batch_size = self.batch_size

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(
        cls,
        *,
        req_pool_indices: Sequence[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        out_cache_loc: torch.Tensor | Sequence[int],
        input_ids: torch.Tensor | Sequence[int] | None = None,
        positions: torch.Tensor | Sequence[int] | None = None,
        forward_mode: ForwardMode | None = None,
        device: torch.device | str = "cpu",
        table_write_pending: bool = False,
        draft_parents: Sequence[Sequence[int]] | None = None,
    ) -> ForwardBatch:
        """Build a batch from host lists.

        ``forward_mode`` defaults to DECODE when every request adds one token to a non-empty sequence, MIXED
        when some do and others prefill, EXTEND when none do, IDLE for no requests. ``positions`` default to
        each request's ``prefix .. prefix + extend - 1``; ``input_ids`` default to zeros (attention-only use).

        Raises InvalidBatchError, before anything reaches the device, when the host values disagree: per-request
        lists of different lengths, a negative length or row, non-integer lengths, ``out_cache_loc`` /
        ``input_ids`` / ``positions`` without one entry per new token, or a ``forward_mode`` the lengths
        contradict. Whether the batch fits a KV cache is ``check``'s job (backends run it).

        ``table_write_pending``: ``out_cache_loc`` came from ``kv.alloc_extend(..., defer_table_write=True)`` (a
        host tensor, uploaded here with the other fields), and the batch's step writes it into the request table
        (see the field). With more than one new token per request (a verify step) each token's table row and
        position go up in the same copy.

        ``draft_parents`` (forward_mode TARGET_VERIFY only): the draft tree, checked by ``draft_tree.
        check_draft_parents``; ``positions`` then default to ``draft_tree.tree_positions`` (prefix + depth).
        """
        device = torch.device(device)
        prefix_lens = int_list("prefix_lens", prefix_lens)
        extend_lens = int_list("extend_lens", extend_lens)
        req_idx = int_list("req_pool_indices", req_pool_indices)
        bs = len(req_idx)
        if not (len(prefix_lens) == len(extend_lens) == bs):
            raise InvalidBatchError(
                f"req_pool_indices, prefix_lens and extend_lens must have one entry per request; "
                f"got lengths {bs}, {len(prefix_lens)}, {len(extend_lens)}"
            )
        if bs and (min(prefix_lens) < 0 or min(extend_lens) < 0 or min(req_idx) < 0):
            b = next(i for i in range(bs) if min(prefix_lens[i], extend_lens[i], req_idx[i]) < 0)
            raise InvalidBatchError(
                f"request {b}: prefix_len, extend_len and req_pool_index must be >= 0, got prefix_len="
                f"{prefix_lens[b]}, extend_len={extend_lens[b]}, req_pool_index={req_idx[b]}"
            )
        if draft_parents is not None:
            verify = forward_mode is not None and ForwardMode(forward_mode).is_verify()
            draft_parents = check_draft_parents(draft_parents, extend_lens, verify=verify)
            positions = tree_positions(prefix_lens, draft_parents) if positions is None else positions
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        num_tokens = sum(extend_lens)
        for name, value in (("out_cache_loc", out_cache_loc), ("input_ids", input_ids), ("positions", positions)):
            if value is not None and (n := num_entries(name, value)) != num_tokens:
                raise InvalidBatchError(
                    f"extend_lens {short_list(extend_lens)} sum to {num_tokens} tokens but {name} has {n} entries; "
                    f"give one entry per new token, request after request"
                )
        one_each = extend_lens.count(1) == bs  # one new token per request (decode-shaped)
        if forward_mode is None:
            if bs == 0:
                forward_mode = ForwardMode.IDLE
            elif one_each and min(prefix_lens) > 0:  # every request decodes: no per-request pass
                forward_mode = ForwardMode.DECODE
            elif any(e == 1 and p > 0 for p, e in zip(prefix_lens, extend_lens)):
                forward_mode = ForwardMode.MIXED
            else:
                forward_mode = ForwardMode.EXTEND
        else:
            forward_mode = ForwardMode(forward_mode)
            if forward_mode.is_decode() and not one_each:
                raise InvalidBatchError(
                    f"forward_mode DECODE needs extend_len 1 for every request, got {short_list(extend_lens)}; "
                    f"leave forward_mode None to derive it"
                )
            if forward_mode.is_idle() and bs:
                raise InvalidBatchError(f"forward_mode IDLE needs an empty batch, got {bs} requests")
        start_loc = list(range(bs)) if one_each else [0, *accumulate(extend_lens)][:bs]
        if input_ids is None:
            input_ids = torch.zeros(num_tokens, dtype=torch.int64)
        # Host values go to the device in one copy (both dtypes); default positions are expanded on the host.
        # A pending write of several tokens per request: each token's table row, and its table position where that
        # is not its position (a tree's, or positions given); uploaded with the batch.
        table_index: list = []
        if table_write_pending and not one_each:
            table_index.append(repeat_each(req_idx, extend_lens))
            if positions is not None or draft_parents is not None:
                table_index.append(ragged_arange(prefix_lens, extend_lens))
        if positions is None:  # decode (one token per request): each position is the prefix length
            positions = prefix_lens if one_each else ragged_arange(prefix_lens, extend_lens)
        # A slot tensor already in place is used as it is (on a GPU to_device does the same): the KV cache then
        # recognises the tensor its alloc_extend returned (check()).
        keep_loc = (isinstance(out_cache_loc, torch.Tensor) and out_cache_loc.is_cpu and device.type == "cpu"
                    and out_cache_loc.dtype == torch.int64)
        try:  # one copy; input ids first, at storage offset 0 (else duck sizing ties a compiled model to the offset)
            longs, ints = to_device_groups([
                ([input_ids, positions, req_idx, *(() if keep_loc else (out_cache_loc,)), *table_index],
                 torch.int64),
                ([seq_lens, prefix_lens, extend_lens, start_loc], torch.int32),
            ], device)
        except (TypeError, OverflowError) as exc:  # e.g. a float in a list, a value past int64
            raise InvalidBatchError(f"input_ids, positions and out_cache_loc must hold int64 values: {exc}") from None
        fb = cls(
            forward_mode=forward_mode, batch_size=bs, input_ids=longs[0], positions=longs[1],
            req_pool_indices=longs[2], seq_lens=ints[0], seq_lens_cpu=int_tensor(seq_lens),
            out_cache_loc=out_cache_loc if keep_loc else longs[3], seq_lens_sum=sum(seq_lens),
            extend_prefix_lens=ints[1], extend_seq_lens=ints[2], extend_start_loc=ints[3],
            extend_prefix_lens_cpu=prefix_lens, extend_seq_lens_cpu=extend_lens, req_pool_indices_cpu=req_idx,
            table_write_pending=table_write_pending, draft_parents=draft_parents,
        )
        fb._built = True
        if all(_on_host(v) for v in (input_ids, positions, out_cache_loc)):
            fb.host_tokens = (input_ids, positions, out_cache_loc)
        fb._given_loc = out_cache_loc if isinstance(out_cache_loc, torch.Tensor) else None
        if table_index:
            k = 4 - keep_loc  # the first table field's index among the int64 fields
            fb._table_index = (longs[k], longs[k + 1] if len(table_index) == 2 else longs[1])
        return fb

    @classmethod
    def build_scratch(cls, prefix_lens: Sequence[int], extend_lens: Sequence[int],
                      device: torch.device | str) -> ForwardBatch:
        """A batch of this shape that touches only scratch memory: every request on row ``PAD_REQUEST`` (whose
        table entries all point at ``PAD_SLOT``), every new token written to ``PAD_SLOT``. Valid by construction
        for any cache (``check`` passes it without looking), so start-up can run every step shape before any
        request holds KV."""
        tokens = sum(extend_lens)
        fb = cls.build(req_pool_indices=[PAD_REQUEST] * len(extend_lens), prefix_lens=list(prefix_lens),
                       extend_lens=list(extend_lens), out_cache_loc=[PAD_SLOT] * tokens, input_ids=[0] * tokens,
                       device=device)
        fb._scratch = True
        return fb

    def write_pending_table(self, kv_cache: BatchCache) -> None:
        """Write this batch's new slots into ``kv_cache``'s request table if that is still pending
        (``table_write_pending``): ``req_to_token[req_pool_indices[b], positions[b]] = out_cache_loc[b]`` for one
        token per request, each token's row and table position (uploaded by ``build``) for more; two device ops
        (the slots as int32, an index_put). Backends' eager entry and ``GraphRunner.run`` call it before anything
        reads the table; a decode graph's input copy writes the table itself instead."""
        if not self.table_write_pending:
            return
        if self._table_index is not None:
            rows, positions = self._table_index
            kv_cache.req_to_token[rows, positions] = self.out_cache_loc.to(torch.int32)
        elif self.num_tokens != self.batch_size:
            raise InvalidBatchError(
                f"the batch's request-table write is pending but it has {self.num_tokens} tokens for "
                f"{self.batch_size} requests and no per-token table rows; build it with ForwardBatch.build(..., "
                f"table_write_pending=True), not field by field or with dataclasses.replace"
            )
        elif self.batch_size:
            kv_cache.req_to_token[self.req_pool_indices, self.positions] = self.out_cache_loc.to(torch.int32)
        self.table_write_pending = False

    # ------------------------------------------------------------------ derived sizes
    @property
    def num_tokens(self) -> int:
        """Tokens in this step, padding included."""
        return int(self.out_cache_loc.shape[0])

    @property
    def num_request_tokens(self) -> int:
        """Tokens that belong to a request (``num_tokens`` minus trailing padding tokens)."""
        return sum(self.extend_seq_lens_cpu)

    @property
    def device(self) -> torch.device:
        return self.out_cache_loc.device

    def chain_verify_tokens(self) -> int | None:
        """Q when this is a chain verify batch (``TARGET_VERIFY`` without ``draft_parents``) whose requests all verify
        the same Q tokens (a graph runner's verify view: its padded requests too), else None. Host lists only."""
        if not self.forward_mode.is_verify() or self.draft_parents is not None or not self.batch_size:
            return None
        lens = self.extend_seq_lens_cpu
        q = lens[0]
        return q if q > 0 and lens.count(q) == len(lens) else None

    # ------------------------------------------------------------------ validation
    def validate(self, kv_cache: BatchCache | None = None) -> None:
        """Raise InvalidBatchError naming the first inconsistent field and its values.

        Checks lengths of every per-request and per-token field, non-negative lengths, ``prefix <= seq_len``,
        ``seq_len == prefix + extend``, the device tensors against the host values, the mode, and, when
        ``kv_cache`` is given, that slots, request rows and sequence lengths fit it: each live request's row
        allocated and used once, ``prefix + extend`` within the row's allocated tokens, each token's slot the one
        the row holds for its position. Reads device tensors, so it syncs: tests and debug mode only."""
        bs = self.batch_size
        for name in ("req_pool_indices", "seq_lens", "seq_lens_cpu", "extend_prefix_lens", "extend_seq_lens",
                     "extend_start_loc", "extend_prefix_lens_cpu", "extend_seq_lens_cpu"):
            if (n := len(getattr(self, name))) != bs:
                raise InvalidBatchError(f"ForwardBatch.{name} has {n} entries but batch_size is {bs}")
        t = self.num_tokens
        for name in ("input_ids", "positions"):
            n = len(getattr(self, name))
            if n != t:
                raise InvalidBatchError(f"ForwardBatch.{name} has {n} entries but out_cache_loc has {t} tokens")
        prefix = self.extend_prefix_lens_cpu
        extend = self.extend_seq_lens_cpu
        seq = [int(x) for x in self.seq_lens_cpu.tolist()]
        for b in range(bs):
            if prefix[b] < 0 or extend[b] < 0:
                raise InvalidBatchError(
                    f"request {b}: lengths must be non-negative, got prefix_len={prefix[b]}, extend_len={extend[b]}"
                )
            if prefix[b] > seq[b]:
                raise InvalidBatchError(
                    f"request {b}: prefix_len {prefix[b]} is longer than its sequence (seq_len {seq[b]})"
                )
            if prefix[b] + extend[b] != seq[b]:
                raise InvalidBatchError(
                    f"request {b}: seq_len {seq[b]} != prefix_len {prefix[b]} + extend_len {extend[b]}"
                )
        if self.num_request_tokens > t or (self.graph_bucket is None and self.num_request_tokens != t):
            raise InvalidBatchError(
                f"extend_seq_lens sum to {self.num_request_tokens} tokens but the batch has {t} tokens "
                f"(padding tokens are only allowed in graph-bucket views)"
            )
        if self.seq_lens_sum != sum(seq):
            raise InvalidBatchError(f"seq_lens_sum is {self.seq_lens_sum} but seq_lens sum to {sum(seq)}")
        # Device tensors against the host view (a graph view's padded requests hold fill values: seq_lens only).
        real = bs if self.graph_bucket is None else self.real_batch_size
        host = {
            "seq_lens": seq,
            "extend_prefix_lens": prefix[:real],
            "extend_seq_lens": extend[:real],
            "extend_start_loc": [sum(extend[:b]) for b in range(real)],
        }
        if self.req_pool_indices_cpu is not None:
            host["req_pool_indices"] = self.req_pool_indices_cpu[:real]
        for name, values in host.items():
            on_device = [int(x) for x in getattr(self, name)[: len(values)].tolist()]
            if on_device != list(values):
                raise InvalidBatchError(
                    f"ForwardBatch.{name} on device {short_list(on_device)} differ from the host values "
                    f"{short_list(list(values))}; build batches with ForwardBatch.build"
                )
        if self.forward_mode.is_idle() and bs:
            raise InvalidBatchError(f"forward_mode IDLE needs an empty batch, got batch_size {bs}")
        if self.forward_mode.is_decode() and any(e != 1 for e in extend):
            raise InvalidBatchError(f"forward_mode DECODE needs extend_len 1 for every request, got {extend}")
        if self.draft_parents is not None:
            check_draft_parents(self.draft_parents, extend, verify=self.forward_mode.is_verify())
        if kv_cache is not None:
            kv_cache.check_batch_bounds(self, seq)

    def check(self, kv_cache: BatchCache) -> None:
        """Raise InvalidBatchError unless this batch fits ``kv_cache``; the check every backend's eager entry
        (``init_forward_metadata``) runs, so that no kernel reads or writes outside its buffers.

        Cheap by design, and never a device sync for the engine's batches:

        * A batch from ``build`` whose ``out_cache_loc`` is the tensor ``kv_cache.alloc_extend(rows, lens)``
          returned for exactly its rows and extend lengths, with its prefix lengths the rows' lengths before that
          call (the engine's steps), is valid by construction: three list comparisons.
        * Any other batch from ``build`` (built by hand) is checked: every row allocated and used once, each
          request's ``prefix + extend`` within the row's allocated tokens (host values), and each token's
          ``out_cache_loc`` entry the slot ``req_to_token`` holds for its position (so nothing is written
          outside the pool or into another request's KV). That comparison reads the request table: on a GPU
          one device sync, paid once per batch (until a request is freed).
        * A batch assembled field by field (the dataclass constructor, ``dataclasses.replace``) has no host view
          that is known to agree with its device tensors: it gets ``validate(kv_cache)``, which syncs.
        * Views of a graph runner's static buffers (``graph_bucket`` set) are filled from batches checked here.
        * A batch whose table write is pending (``table_write_pending``) must be the first kind: the table does not
          hold its slots yet, so there is nothing to compare them with.
        """
        if self.graph_bucket is not None or self._scratch:
            return
        rows, prefix, extend = self.req_pool_indices_cpu, self.extend_prefix_lens_cpu, self.extend_seq_lens_cpu
        given = self._given_loc if self._given_loc is not None else self.out_cache_loc
        if self._built and kv_cache.issued(given, rows, prefix, extend):
            return
        if self.table_write_pending:
            raise InvalidBatchError(
                "the batch's request-table write is pending, but its out_cache_loc is not what a recent "
                "kv.alloc_extend(..., defer_table_write=True) returned for its rows (or a request was freed since); "
                "build the batch from that allocation with ForwardBatch.build and run it before freeing requests"
            )
        if not self._built:
            self.validate(kv_cache)
            return
        loc = self.out_cache_loc
        checked = self._checked_against
        if checked is not None and checked[0] is kv_cache and checked[1] is loc and checked[2] == kv_cache.generation:
            return  # checked before, and no request was freed since
        kv_cache.check_rows(rows, prefix, extend)
        kv_cache.check_slots(rows, prefix, extend, loc)
        self._checked_against = (kv_cache, loc, kv_cache.generation)


def _on_host(values: object) -> bool:
    """Whether ``values`` (a step's per-token field as given to ``ForwardBatch.build``) is on the host."""
    return not isinstance(values, torch.Tensor) or values.is_cpu
