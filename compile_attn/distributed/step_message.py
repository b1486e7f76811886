"""One engine step sent from tensor-parallel rank 0 to the other ranks, without pickling and without a device sync
on the receiving side.

Rank 0 (``StepSender``) sends a fixed-size header, then the step's host metadata, on the host group (gloo between
the processes: it never enters a device stream): the per-request fields (request rows, prefix and extend lengths),
the request-table rows that rank 0 rewrote outside a step (``table_rows``: the prefix cache lent or swapped pages)
and, where the batch was built from host values (every decode step), its per-token fields (input ids with their
placeholders, positions, KV slots). What exists only on the device follows as one broadcast on the device group, in
stream order: the per-token fields of a batch built from device tensors, the rows whose logits the LM head computes
(``keep``) and the tokens the placeholders stand for (``feed``: the sampled tokens of the step before, so overlap
needs no host read). A worker (``StepReceiver``) therefore reads the next step's metadata while its device still
runs the step before, and queues the next step behind it: its device never waits for its host.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from compile_attn.batch import ForwardBatch, ForwardMode

HEADER_LEN = 8  # kind, forward mode, batch size, tokens, flags, keep rows (-1: every row), feed tokens, table words
_PENDING, _FEED, _HOST_TOKENS = 1, 2, 4  # flags: table write pending; feed tokens follow; per-token fields on host


class MessageKind(enum.IntEnum):
    """What rank 0 asks of the other ranks."""

    STEP = 1  # run this step's forward
    SHUTDOWN = 2  # leave the step loop
    PROFILE = 3  # start the profiler (a directory follows) or stop it (none follows)


@dataclass(frozen=True)
class ProfileControl:
    """Start the torch profiler with traces going to ``directory``, or stop it (``directory`` None)."""

    directory: str | None


@dataclass
class StepMessage:
    """A step as the other ranks receive it: per-request fields on the host, per-token fields on the host (int64
    CPU tensors) or on the device, ``keep`` and ``feed`` on the device."""

    forward_mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    table_write_pending: bool
    keep: torch.Tensor | None  # None: the LM head runs on every row
    feed: torch.Tensor | None  # what placeholder -(i + 1) stands for: feed[i]
    table_rows: list[tuple[int, np.ndarray]]  # (row, its slots for positions 0 .. n - 1), written before the step


def encode_table_rows(rows: list[tuple[int, np.ndarray]]) -> list[int]:
    """``[row, n, slot_0 .. slot_{n-1}]`` for each rewritten row, flattened."""
    out: list[int] = []
    for row, slots in rows:
        out += [row, len(slots), *slots.tolist()]
    return out


def decode_table_rows(words: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """The inverse of ``encode_table_rows``."""
    rows, i = [], 0
    while i < len(words):
        row, n = int(words[i]), int(words[i + 1])
        rows.append((row, words[i + 2:i + 2 + n]))
        i += 2 + n
    return rows


def _longs(values: object) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.numpy().astype(np.int64, copy=False)
    return np.asarray(values, dtype=np.int64)


class StepSender:
    """Rank 0's side: ``send`` sends one step (``shutdown``: the end) from rank ``src``: metadata on ``host_group``,
    device values on ``group`` (the same group on the CPU)."""

    def __init__(self, group: object, host_group: object, device: torch.device, src: int = 0) -> None:
        self.group, self.host_group, self.device, self.src = group, host_group, device, src

    def send(self, fb: ForwardBatch, keep: torch.Tensor | None, feed: torch.Tensor | None,
             table_rows: list[tuple[int, np.ndarray]]) -> None:
        """Send ``fb`` with the LM head's rows ``keep`` and the placeholders' tokens ``feed`` (device tensors or
        None) and the rewritten table rows (host values)."""
        table = encode_table_rows(table_rows)
        host_tokens = fb.host_tokens
        flags = ((_PENDING if fb.table_write_pending else 0) | (_FEED if feed is not None else 0)
                 | (_HOST_TOKENS if host_tokens is not None else 0))
        header = [int(MessageKind.STEP), int(fb.forward_mode), fb.batch_size, fb.num_tokens, flags,
                  -1 if keep is None else int(keep.shape[0]), 0 if feed is None else int(feed.shape[0]), len(table)]
        host = [fb.req_pool_indices_cpu, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, table]
        host += list(host_tokens or ())
        dist.broadcast(torch.tensor(header, dtype=torch.int64), self.src, group=self.host_group)
        dist.broadcast(torch.from_numpy(np.concatenate([_longs(x) for x in host])), self.src, group=self.host_group)
        parts = [] if host_tokens is not None else [fb.input_ids, fb.positions, fb.out_cache_loc.to(self.device)]
        parts += [t.to(self.device, torch.int64) for t in (keep, feed) if t is not None]
        if parts:
            dist.broadcast(torch.cat(parts), self.src, group=self.group)

    def profile(self, directory: str | None) -> None:
        """Tell the other ranks to start their profilers writing to ``directory`` (None: to stop them)."""
        data = (directory or "").encode()
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[0], header[1] = int(MessageKind.PROFILE), len(data)
        dist.broadcast(header, self.src, group=self.host_group)
        if data:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), self.src, group=self.host_group)

    def shutdown(self) -> None:
        """Tell the other ranks to leave their step loop."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[0] = int(MessageKind.SHUTDOWN)
        dist.broadcast(header, self.src, group=self.host_group)


class StepReceiver:
    """The other ranks' side: ``receive`` waits for rank ``src``'s next message; None means shut down."""

    def __init__(self, group: object, host_group: object, device: torch.device, src: int = 0) -> None:
        self.group, self.host_group, self.device, self.src = group, host_group, device, src
        self._header = torch.empty(HEADER_LEN, dtype=torch.int64)

    def receive(self) -> StepMessage | ProfileControl | None:
        """The next step, a profiler control, or None (shut down)."""
        dist.broadcast(self._header, self.src, group=self.host_group)
        kind, mode, bs, tokens, flags, num_keep, num_feed, num_table = self._header.tolist()
        if kind == MessageKind.SHUTDOWN:
            return None
        if kind == MessageKind.PROFILE:
            if not mode:  # the second word: the directory's length in bytes
                return ProfileControl(None)
            data = torch.empty(mode, dtype=torch.uint8)
            dist.broadcast(data, self.src, group=self.host_group)
            return ProfileControl(data.numpy().tobytes().decode())
        if kind != MessageKind.STEP:
            raise RuntimeError(f"tensor-parallel step message of unknown kind {kind}: the ranks are out of step")
        host_tokens = bool(flags & _HOST_TOKENS)
        host = torch.empty(3 * bs + num_table + (3 * tokens if host_tokens else 0), dtype=torch.int64)
        dist.broadcast(host, self.src, group=self.host_group)
        rows, prefix, extend, table, ids, pos, loc = torch.split(
            host, [bs, bs, bs, num_table] + ([tokens] * 3 if host_tokens else [0] * 3))
        keep_all, num_keep = num_keep < 0, max(num_keep, 0)
        size = (0 if host_tokens else 3 * tokens) + num_keep + num_feed
        if size:
            payload = torch.empty(size, dtype=torch.int64, device=self.device)
            dist.broadcast(payload, self.src, group=self.group)
            device_tokens, keep, feed = torch.split(payload, [size - num_keep - num_feed, num_keep, num_feed])
            if not host_tokens:
                ids, pos, loc = torch.split(device_tokens, [tokens] * 3)
        else:
            keep = feed = None
        return StepMessage(
            forward_mode=ForwardMode(mode), input_ids=ids, positions=pos, out_cache_loc=loc,
            req_pool_indices=rows.tolist(), prefix_lens=prefix.tolist(), extend_lens=extend.tolist(),
            table_write_pending=bool(flags & _PENDING), keep=None if keep_all else keep,
            feed=feed if flags & _FEED else None, table_rows=decode_table_rows(table.numpy()),
        )
