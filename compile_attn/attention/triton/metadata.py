"""Per-step metadata of the triton attention backend: decode token CSRs, split-K scratch, extend offsets, the
static decode buffers graphs read, and the bound launches of graph-bound decode layers.

Data only: the backend (``attention/triton/backend.py``, ``prepare.py``) fills these; the kernels
(``attention/kernels``) read them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class DecodeIndex:
    """Token CSR of one decode step for the layers of one sliding window (``window`` None: full attention).

    Request b reads slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``: positions ``kv_start[b]`` (0
    for full attention) to ``seq_len - 1``. ``kv_indices`` may be longer than the step needs.
    """

    window: int | None
    kv_indptr: torch.Tensor  # [bs + 1] int32
    kv_indices: torch.Tensor  # [>= tokens read] int32
    num_kv_splits: torch.Tensor  # [bs] int32
    kv_start: torch.Tensor | None  # [bs] int32, window layers only

    @classmethod
    def allocate(cls, window: int | None, bs: int, num_indices: int, device: torch.device, zero: bool) -> DecodeIndex:
        new = torch.zeros if zero else torch.empty
        return cls(
            window=window,
            kv_indptr=new(bs + 1, dtype=torch.int32, device=device),
            kv_indices=new(max(num_indices, 1), dtype=torch.int32, device=device),
            num_kv_splits=new(bs, dtype=torch.int32, device=device),
            kv_start=new(bs, dtype=torch.int32, device=device) if window is not None else None,
        )

    def head(self, bs: int) -> DecodeIndex:
        """Views for the first ``bs`` requests (same storage: what a graph bucket binds)."""
        return DecodeIndex(
            window=self.window,
            kv_indptr=self.kv_indptr[: bs + 1],
            kv_indices=self.kv_indices,
            num_kv_splits=self.num_kv_splits[:bs],
            kv_start=self.kv_start[:bs] if self.kv_start is not None else None,
        )


@dataclass
class SplitScratch:
    """fp32 per-split partial outputs and log-sum-exps of split-K decode, for one (num_heads, v_head_dim), and the
    counters that let the split kernel merge them itself (one launch per decode layer)."""

    attn_logits: torch.Tensor  # [>= bs, Hq, max_kv_splits, Dv]
    attn_lse: torch.Tensor  # [>= bs, Hq, max_kv_splits]
    semaphores: torch.Tensor  # int32 [>= bs, Hq], zero between launches

    @classmethod
    def allocate(cls, bs: int, num_heads: int, v_head_dim: int, max_kv_splits: int, device: torch.device) -> SplitScratch:
        return cls(
            attn_logits=torch.empty(bs, num_heads, max_kv_splits, v_head_dim, dtype=torch.float32, device=device),
            attn_lse=torch.empty(bs, num_heads, max_kv_splits, dtype=torch.float32, device=device),
            semaphores=torch.zeros(bs, num_heads, dtype=torch.int32, device=device),
        )

    @property
    def capacity(self) -> int:
        return int(self.attn_logits.shape[0])


@dataclass
class DecodeStep:
    """Decode metadata of one step: one token CSR per window, scratch per head shape."""

    batch_size: int
    indexes: dict[int | None, DecodeIndex]
    scratch: dict[tuple[int, int], SplitScratch]
    filled: bool = False  # set by init_forward_metadata_in_graph
    graph_bound: bool = False  # indexes and scratch are the static graph buffers' (same objects every step)


def decode_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   loc: torch.Tensor | None) -> tuple:
    """What a decode layer's launch depends on besides the layer, the step's metadata buffers and the KV pool:
    where and how q, k, v, out and the new tokens' slots lie."""
    return (
        q.data_ptr(), q.shape, q.stride(), q.dtype, k.data_ptr(), k.shape, k.stride(), k.dtype,
        v.data_ptr(), v.shape, v.stride(), v.dtype, out.data_ptr(), out.shape, out.stride(), out.dtype,
        None if loc is None else (loc.data_ptr(), loc.shape, loc.dtype),
    )


@dataclass
class DecodePlan:
    """A decode layer's launch bound for repeats (``decode_attention_fwd_and_bind``), valid while the layer is
    called with the same ``inputs`` (``decode_inputs``) and the same graph-bound ``indexes``. Holds no tensor
    of the step (addresses only); ``indexes`` are the backend's static buffers."""

    inputs: tuple
    indexes: dict[int | None, DecodeIndex]
    launch: Callable[[], bool]


@dataclass
class TreeMask:
    """A verification step's draft trees as the extend kernel reads them: per request an ``[n, n]`` ancestor mask
    over its new keys (every cached key is visible) and the new tokens' positions (``prefix + depth``), which the
    sliding window uses."""

    mask: torch.Tensor  # uint8, the requests' [n, n] masks row-major, one after another
    mask_indptr: torch.Tensor  # [bs + 1] int32 offsets into mask
    positions: torch.Tensor  # [num_tokens] int32

    def kernel_args(self) -> dict:
        return dict(custom_mask=self.mask, mask_indptr=self.mask_indptr, mask_new_keys_only=True,
                    positions=self.positions)


@dataclass
class ExtendStep:
    """Extend/mixed/verify metadata: new-token offsets, the token CSR of each request's cached prefix, and a
    verification step's draft trees.

    With ``decode`` set (a mixed batch's leading decode rows, ``triton/mixed.py``) its ``decode_rows`` first requests
    (one token each: the batch's first ``decode_rows`` tokens) run in the decode kernel over ``decode``'s CSRs, and
    the offsets (``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``max_len_extend``) describe the requests after them
    only, their tokens counted from token ``decode_rows``."""

    num_tokens: int  # tokens that belong to a request (decode rows included); padding tokens of a bucket follow
    qo_indptr: torch.Tensor  # [extend requests + 1] int32
    kv_indptr: torch.Tensor  # [extend requests + 1] int32, prefix lengths
    kv_indices: torch.Tensor  # [>= total prefix] int32
    max_len_extend: int
    draft_parents: tuple[tuple[int, ...], ...] | None = None  # the batch's, as prepared
    tree: TreeMask | None = None  # set when some request's draft_parents are not a chain
    decode: DecodeStep | None = None  # the leading decode rows' decode step (filled), if they are split off

    @property
    def decode_rows(self) -> int:
        """Requests (and tokens) at the batch's start that run in the decode kernel."""
        return 0 if self.decode is None else self.decode.batch_size


@dataclass
class DecodeGraphBuffers:
    """Static buffers of decode graphs with up to ``max_bs`` requests, or verify graphs of up to ``max_bs`` query rows
    (allocated once)."""

    max_bs: int
    indexes: dict[int | None, DecodeIndex]
    scratch: dict[tuple[int, int], SplitScratch]
    # A tree verify graph's ancestor bits, one int64 word per query row (``verify_mode.py``), written out of graph.
    tree_mask: torch.Tensor
    heads: dict[int, dict[int | None, DecodeIndex]] = field(default_factory=dict)  # views per bucket, made once

    def head(self, bs: int) -> dict[int | None, DecodeIndex]:
        """Every window's index views for the first ``bs`` requests: sliced on a bucket's first step, then reused
        (slicing costs host time on every decode step of a graph runner)."""
        views = self.heads.get(bs)
        if views is None:
            views = self.heads[bs] = {w: idx.head(bs) for w, idx in self.indexes.items()}
        return views
