"""One engine step sent from tensor-parallel rank 0 to the other ranks as two int64 broadcasts, without pickling.

Rank 0 (``StepSender``) broadcasts a fixed-size header, then a payload whose layout the header gives: the batch's
per-token fields (input ids with their placeholders, positions, KV slots), its per-request fields (request rows,
prefix and extend lengths), the rows whose logits the LM head computes (``keep``), the tokens that the placeholders
stand for (``feed``: the sampled tokens of the step before, copied on the device, so overlap needs no host read),
and the request-table rows that rank 0 rewrote outside a step (``table_rows``: the prefix cache lent or swapped
pages). The payload is assembled on the batch's device (NCCL needs device tensors; gloo takes CPU ones) with one
upload of the host lists and device-side copies of the device tensors: rank 0 never waits for the device. The other
ranks (``StepReceiver``) read the header, then the payload, to the host and rebuild the step (``StepMessage``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from compile_attn.batch import ForwardBatch, ForwardMode
from compile_attn.host_tensors import to_device

HEADER_LEN = 8  # kind, forward mode, batch size, tokens, flags, keep rows (-1: every row), feed tokens, table words
_PENDING, _FEED = 1, 2  # flag bits: the batch's table write is pending; the step carries feed tokens


class MessageKind(enum.IntEnum):
    """What rank 0 asks of the other ranks."""

    STEP = 1  # run this step's forward
    SHUTDOWN = 2  # leave the step loop


@dataclass
class StepMessage:
    """A step as the other ranks receive it, on the host (lists and int64 CPU tensors)."""

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


class StepSender:
    """Rank 0's side: ``send`` broadcasts one step (or ``shutdown`` the end) on ``group`` from rank ``src``."""

    def __init__(self, group: object, device: torch.device, src: int = 0) -> None:
        self.group, self.device, self.src = group, device, src

    def _broadcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, self.src, group=self.group)

    def send(self, fb: ForwardBatch, keep: torch.Tensor | None, feed: torch.Tensor | None,
             table_rows: list[tuple[int, np.ndarray]]) -> None:
        """Broadcast ``fb`` with the LM head's rows ``keep`` and the placeholders' tokens ``feed`` (device tensors or
        None) and the rewritten table rows (host values)."""
        table = encode_table_rows(table_rows)
        flags = (_PENDING if fb.table_write_pending else 0) | (_FEED if feed is not None else 0)
        header = [int(MessageKind.STEP), int(fb.forward_mode), fb.batch_size, fb.num_tokens, flags,
                  -1 if keep is None else int(keep.shape[0]), 0 if feed is None else int(feed.shape[0]), len(table)]
        host = [header, fb.req_pool_indices_cpu, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, table]
        uploaded = to_device([np.concatenate([np.asarray(x, dtype=np.int64) for x in host])], torch.int64,
                             self.device)[0]
        parts = [fb.input_ids, fb.positions, fb.out_cache_loc.to(self.device), uploaded[HEADER_LEN:]]
        parts += [t.to(self.device, torch.int64) for t in (keep, feed) if t is not None]
        self._broadcast(uploaded[:HEADER_LEN].clone())
        self._broadcast(torch.cat(parts))

    def shutdown(self) -> None:
        """Tell the other ranks to leave their step loop."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.device)
        header[0] = int(MessageKind.SHUTDOWN)
        self._broadcast(header)


class StepReceiver:
    """The other ranks' side: ``receive`` waits for rank ``src``'s next message; None means shut down."""

    def __init__(self, group: object, device: torch.device, src: int = 0) -> None:
        self.group, self.device, self.src = group, device, src
        self._header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)

    def receive(self) -> StepMessage | None:
        dist.broadcast(self._header, self.src, group=self.group)
        kind, mode, bs, tokens, flags, num_keep, num_feed, num_table = self._header.tolist()
        if kind == MessageKind.SHUTDOWN:
            return None
        if kind != MessageKind.STEP:
            raise RuntimeError(f"tensor-parallel step message of unknown kind {kind}: the ranks are out of step")
        size = 3 * tokens + 3 * bs + num_table + max(num_keep, 0) + num_feed
        payload = torch.empty(size, dtype=torch.int64, device=self.device)
        dist.broadcast(payload, self.src, group=self.group)
        host = payload.cpu()
        cuts = np.cumsum([tokens, tokens, tokens, bs, bs, bs, num_table, max(num_keep, 0), num_feed])
        ids, pos, loc, rows, prefix, extend, table, keep, feed = np.split(host.numpy(), cuts[:-1])
        return StepMessage(
            forward_mode=ForwardMode(mode), input_ids=torch.from_numpy(ids), positions=torch.from_numpy(pos),
            out_cache_loc=torch.from_numpy(loc), req_pool_indices=rows.tolist(), prefix_lens=prefix.tolist(),
            extend_lens=extend.tolist(), table_write_pending=bool(flags & _PENDING),
            keep=None if num_keep < 0 else torch.from_numpy(keep),
            feed=torch.from_numpy(feed) if flags & _FEED else None, table_rows=decode_table_rows(table),
        )
