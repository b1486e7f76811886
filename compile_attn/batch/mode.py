"""What kind of step a batch is (``ForwardMode``), the scratch row and slot that padding uses, and the shared-prefix
groups a decode batch may carry: the vocabulary ``ForwardBatch`` and the backends share."""

from __future__ import annotations

import enum
from dataclasses import dataclass

PAD_SLOT = 0  # the scratch slot (page 0): padding tokens write their KV here, never into a live request's
PAD_REQUEST = 0  # the scratch request row: its table entries all point at PAD_SLOT


@dataclass(frozen=True)
class SharedPrefixGroup:
    """Requests ``members`` (indices into the batch) hold the same KV slots at positions ``0 .. prefix_len - 1``
    (found by ``kv/shared_prefix.py``; read by the backends' shared-prefix decode)."""

    members: tuple[int, ...]
    prefix_len: int


class ForwardMode(enum.IntEnum):
    """What kind of step a batch is."""

    EXTEND = 1  # prefill / chunked prefill: requests add one or more tokens each
    DECODE = 2  # every request adds exactly one token to an existing sequence
    MIXED = 3  # prefill requests and decode requests in one step
    IDLE = 4  # no requests (keeps collective ops in step in multi-rank setups)
    # Speculative verification: each request adds its last accepted token and its draft tokens; without
    # ``ForwardBatch.draft_parents`` they form a chain (causal, as an extend), with it a tree (draft_tree.py).
    TARGET_VERIFY = 5

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE

    def is_verify(self) -> bool:
        return self is ForwardMode.TARGET_VERIFY
