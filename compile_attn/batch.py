"""ForwardMode and ForwardBatch: one step's batch, with its host and device views.

A batch is a list of requests; request b contributes ``extend_seq_lens[b]`` new tokens at positions
``extend_prefix_lens[b] .. seq_lens[b] - 1`` (decode is the case where every request adds one token).
Tokens are laid out request after request. A batch padded for a CUDA graph bucket may carry padding
tokens after the last request's tokens; they belong to no request and write KV only to the scratch slot.
This module builds and validates batches; it never allocates KV slots (see ``kv_cache``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from compile_attn.errors import InvalidBatchError
from compile_attn.host_tensors import int_tensor, ragged_arange, to_device

if TYPE_CHECKING:
    from compile_attn.kv_cache import KVCache


class ForwardMode(enum.IntEnum):
    """What kind of step a batch is."""

    EXTEND = 1  # prefill / chunked prefill: requests add one or more tokens each
    DECODE = 2  # every request adds exactly one token to an existing sequence
    MIXED = 3  # prefill requests and decode requests in one step
    IDLE = 4  # no requests (keeps collective ops in step in multi-rank setups)

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_extend(self) -> bool:
        """EXTEND and MIXED both run the extend (variable-length) attention path."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE


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
    ) -> ForwardBatch:
        """Build a batch from host lists.

        ``forward_mode`` defaults to DECODE when every request adds one token to a non-empty
        sequence, MIXED when some do and others prefill, EXTEND when none do, IDLE for no requests. ``positions`` default to each request's
        ``prefix .. prefix + extend - 1``; ``input_ids`` default to zeros (attention-only use).
        """
        device = torch.device(device)
        prefix_lens = [int(x) for x in prefix_lens]
        extend_lens = [int(x) for x in extend_lens]
        req_idx = [int(x) for x in req_pool_indices]
        bs = len(req_idx)
        if not (len(prefix_lens) == len(extend_lens) == bs):
            raise InvalidBatchError(
                f"req_pool_indices, prefix_lens and extend_lens must have one entry per request; "
                f"got lengths {bs}, {len(prefix_lens)}, {len(extend_lens)}"
            )
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        num_tokens = sum(extend_lens)
        if forward_mode is None:
            is_decode = [e == 1 and p > 0 for p, e in zip(prefix_lens, extend_lens)]
            if bs == 0:
                forward_mode = ForwardMode.IDLE
            elif all(is_decode):
                forward_mode = ForwardMode.DECODE
            elif any(is_decode):
                forward_mode = ForwardMode.MIXED
            else:
                forward_mode = ForwardMode.EXTEND
        start_loc, acc = [], 0
        for e in extend_lens:
            start_loc.append(acc)
            acc += e
        if input_ids is None:
            input_ids = torch.zeros(num_tokens, dtype=torch.int64)
        # Host values go to the device in one copy per dtype; default positions are expanded on the host.
        if positions is None:  # decode (one token per request): each position is the prefix length
            positions = prefix_lens if num_tokens == bs and extend_lens.count(1) == bs else (
                ragged_arange(prefix_lens, extend_lens))
        ints = to_device([seq_lens, prefix_lens, extend_lens, start_loc], torch.int32, device)
        longs = to_device([input_ids, positions, req_idx, out_cache_loc], torch.int64, device)
        return cls(
            forward_mode=forward_mode,
            batch_size=bs,
            input_ids=longs[0],
            positions=longs[1],
            req_pool_indices=longs[2],
            seq_lens=ints[0],
            seq_lens_cpu=int_tensor(seq_lens),
            out_cache_loc=longs[3],
            seq_lens_sum=sum(seq_lens),
            extend_prefix_lens=ints[1],
            extend_seq_lens=ints[2],
            extend_start_loc=ints[3],
            extend_prefix_lens_cpu=prefix_lens,
            extend_seq_lens_cpu=extend_lens,
        )

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

    # ------------------------------------------------------------------ validation
    def validate(self, kv_cache: KVCache | None = None) -> None:
        """Raise InvalidBatchError naming the first inconsistent field and its values.

        Checks lengths of every per-request and per-token field, non-negative lengths,
        ``prefix <= seq_len``, ``seq_len == prefix + extend``, the mode, and, when ``kv_cache`` is
        given, that slots, request rows and sequence lengths fit it. Reads device tensors, so it
        syncs: call it in tests and debug mode, not per step in production.
        """
        bs = self.batch_size
        per_request = {
            "req_pool_indices": len(self.req_pool_indices),
            "seq_lens": len(self.seq_lens),
            "seq_lens_cpu": len(self.seq_lens_cpu),
            "extend_prefix_lens": len(self.extend_prefix_lens),
            "extend_seq_lens": len(self.extend_seq_lens),
            "extend_start_loc": len(self.extend_start_loc),
            "extend_prefix_lens_cpu": len(self.extend_prefix_lens_cpu),
            "extend_seq_lens_cpu": len(self.extend_seq_lens_cpu),
        }
        for name, n in per_request.items():
            if n != bs:
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
        dev_seq = [int(x) for x in self.seq_lens.tolist()]
        if dev_seq != seq:
            raise InvalidBatchError(f"seq_lens on device {dev_seq} differ from seq_lens_cpu {seq}")
        if self.forward_mode.is_idle() and bs:
            raise InvalidBatchError(f"forward_mode IDLE needs an empty batch, got batch_size {bs}")
        if self.forward_mode.is_decode() and any(e != 1 for e in extend):
            raise InvalidBatchError(f"forward_mode DECODE needs extend_len 1 for every request, got {extend}")
        if kv_cache is not None:
            self._validate_against(kv_cache, seq)

    def _validate_against(self, kv_cache: KVCache, seq: list[int]) -> None:
        if self.num_tokens:
            lo, hi = int(self.out_cache_loc.min()), int(self.out_cache_loc.max())
            if lo < 0 or hi >= kv_cache.pool.num_slots:
                raise InvalidBatchError(
                    f"out_cache_loc has slots in [{lo}, {hi}] but the KV pool has slots 0..{kv_cache.pool.num_slots - 1}"
                )
        if self.batch_size:
            rows = self.req_pool_indices
            lo, hi = int(rows.min()), int(rows.max())
            if lo < 0 or hi >= kv_cache.req_to_token_pool.num_rows:
                raise InvalidBatchError(
                    f"req_pool_indices in [{lo}, {hi}] but the request table has rows "
                    f"0..{kv_cache.req_to_token_pool.num_rows - 1}"
                )
            longest = max(seq)
            if longest > kv_cache.max_context:
                raise InvalidBatchError(
                    f"seq_len {longest} exceeds the KV cache's max_context {kv_cache.max_context}; "
                    f"create the KVCache with a larger max_context"
                )
