"""An engine step's small device ops as single kernels: the feed of the previous step's sampled tokens into the
placeholders of this step's input ids (engine/execution/in_flight.py), alone or folded into the copy of a decode step's
inputs into the graph runner's static buffers, which also writes the step's new KV slots into the request table.

Each is one Triton launch on a GPU (and on the CPU when the kernels are interpreted, ``TRITON_INTERPRET=1``), in
place of the seven torch ops of the feed, the two ``_foreach_copy_`` of the copy and the table's index_put;
elsewhere the same result comes from those torch ops. Every integer argument and pointer alignment is left
unspecialised, so one compiled kernel serves every batch size and every offset of the step's uploaded inputs
(``warm_up`` builds them all). It sits with the graph runner, whose decode replay copies inputs through it; the
engine's in-flight feed calls it from above. It knows nothing of the engine's requests.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from compile_attn.ops.triton_launch import is_interpreted, launch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch ops serve
    triton = None

FEED_BLOCK = 1024  # input ids per program of the feed (a prefill's thousands of tokens: a few programs)
COPY_BLOCK = 256  # requests per program of the decode copy
_COPY_POINTERS = ["Ids_Dst", "Ids_Src", "Pos_Dst", "Pos_Src", "Loc_Dst", "Loc_Src", "Rows_Dst", "Rows_Src", "Seq_Dst",
                  "Seq_Src", "Pre_Dst", "Pre_Src", "Tokens", "Table"]


@dataclass(frozen=True)
class TokenFeed:
    """What a step's placeholders stand for: placeholder ``-(i + 1)`` is ``tokens[i]`` (the step in flight's
    sampled tokens, on the device), clamped into ``[0, vocab_size)`` when the vocabulary is known."""

    tokens: torch.Tensor
    vocab_size: int | None

    def apply(self, input_ids: torch.Tensor) -> None:
        """Replace the placeholders of ``input_ids`` in place."""
        feed_tokens(input_ids, self.tokens, self.vocab_size)


if triton is not None:

    def _jit(**options: object):  # noqa: ANN202
        """``triton.jit`` with these options, less pointer-alignment ones a Triton without them does not take."""
        if "do_not_specialize_on_alignment" not in inspect.signature(triton.jit).parameters:
            options.pop("do_not_specialize_on_alignment", None)
        return triton.jit(**options)

    @triton.jit
    def _fed(x, Tokens, num_tokens, vocab_size, mask, HAS_VOCAB: tl.constexpr):
        """``x`` with each negative entry ``-(i + 1)`` replaced by ``Tokens[i]`` (``i`` clamped into the tokens,
        the token clamped into the vocabulary)."""
        placeholder = x < 0
        row = tl.minimum(tl.maximum(-x - 1, 0), num_tokens - 1)
        tok = tl.load(Tokens + row, mask=mask & placeholder, other=0).to(tl.int64)
        if HAS_VOCAB:
            tok = tl.minimum(tl.maximum(tok, 0), vocab_size - 1)
        return tl.where(placeholder, tok, x.to(tl.int64))

    @_jit(do_not_specialize=["n", "num_tokens", "vocab_size"], do_not_specialize_on_alignment=["Ids", "Tokens"])
    def _feed_kernel(Ids, Tokens, n, num_tokens, vocab_size, HAS_VOCAB: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(Ids + offs, mask=mask, other=0)
        tl.store(Ids + offs, _fed(x, Tokens, num_tokens, vocab_size, mask, HAS_VOCAB).to(x.dtype), mask=mask)

    @_jit(do_not_specialize=["n", "num_tokens", "vocab_size", "table_stride"],
          do_not_specialize_on_alignment=_COPY_POINTERS)
    def _copy_decode_kernel(Ids_Dst, Ids_Src, Pos_Dst, Pos_Src, Loc_Dst, Loc_Src, Rows_Dst, Rows_Src, Seq_Dst,
                            Seq_Src, Pre_Dst, Pre_Src, Tokens, Table, n, num_tokens, vocab_size, table_stride,
                            FEED: tl.constexpr, HAS_VOCAB: tl.constexpr, TABLE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        ids = tl.load(Ids_Src + offs, mask=mask, other=0)
        if FEED:
            ids = _fed(ids, Tokens, num_tokens, vocab_size, mask, HAS_VOCAB)
        tl.store(Ids_Dst + offs, ids.to(Ids_Dst.dtype.element_ty), mask=mask)
        pos = tl.load(Pos_Src + offs, mask=mask, other=0)
        loc = tl.load(Loc_Src + offs, mask=mask, other=0)
        rows = tl.load(Rows_Src + offs, mask=mask, other=0)
        tl.store(Pos_Dst + offs, pos.to(Pos_Dst.dtype.element_ty), mask=mask)
        tl.store(Loc_Dst + offs, loc.to(Loc_Dst.dtype.element_ty), mask=mask)
        tl.store(Rows_Dst + offs, rows.to(Rows_Dst.dtype.element_ty), mask=mask)
        tl.store(Seq_Dst + offs, tl.load(Seq_Src + offs, mask=mask).to(Seq_Dst.dtype.element_ty), mask=mask)
        tl.store(Pre_Dst + offs, tl.load(Pre_Src + offs, mask=mask).to(Pre_Dst.dtype.element_ty), mask=mask)
        if TABLE:  # request b's new token: table[rows[b], positions[b]] = its slot
            entry = rows.to(tl.int64) * table_stride + pos.to(tl.int64)
            tl.store(Table + entry, loc.to(Table.dtype.element_ty), mask=mask)


def kernels_usable(t: torch.Tensor) -> bool:
    """Whether the Triton kernels run on ``t``'s device: a GPU, or the CPU when they are interpreted."""
    if triton is None:
        return False
    return t.is_cuda or (t.is_cpu and is_interpreted(_feed_kernel))


def feed_tokens(input_ids: torch.Tensor, tokens: torch.Tensor, vocab_size: int | None) -> None:
    """Replace, in place and on the device, each placeholder ``-(i + 1)`` in ``input_ids`` with ``tokens[i]``.

    A token outside the vocabulary (the request finishes with an error once the host sees it) is clamped into it
    here, so that the step computing the extra token does not index the embedding out of bounds. One kernel
    (``kernels_usable``), else ``feed_tokens_torch``.
    """
    n, num_tokens = input_ids.numel(), tokens.numel()
    if num_tokens == 0 or n == 0:
        return
    if not (kernels_usable(input_ids) and input_ids.is_contiguous() and tokens.is_contiguous()):
        feed_tokens_torch(input_ids, tokens, vocab_size)
        return
    launch(_feed_kernel, (triton.cdiv(n, FEED_BLOCK),), input_ids, tokens, n, num_tokens, vocab_size or 0,
           HAS_VOCAB=bool(vocab_size), BLOCK=FEED_BLOCK)


def feed_tokens_torch(input_ids: torch.Tensor, tokens: torch.Tensor, vocab_size: int | None) -> None:
    """``feed_tokens`` in torch ops (seven kernels on a GPU)."""
    if tokens.numel() == 0:
        return
    rows = input_ids.neg().sub_(1).clamp_(0, tokens.numel() - 1)
    fed = tokens.index_select(0, rows)
    if vocab_size:
        fed.clamp_(0, vocab_size - 1)
    torch.where(input_ids < 0, fed, input_ids, out=input_ids)


def copy_decode_inputs(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], feed: TokenFeed | None,
                       table: torch.Tensor | None = None) -> None:
    """``dst.copy_(src)`` for the six fields of a decode step (input ids, positions, KV slots, request rows, then
    the int32 sequence and prefix lengths; one entry per request each) into the graph runner's static buffers,
    the placeholders of the input ids replaced on the way (``feed``). With ``table`` (the KV cache's request
    table, ``[rows, max_context]``, row-major), each request's new slot is also written into it:
    ``table[rows[b], positions[b]] = slots[b]`` (the table write a deferred allocation left to the step, see
    ``KVCache.alloc_extend``). One kernel (``kernels_usable``), which leaves the sources as they are; else the
    feed in place in the source ids, a ``_foreach_copy_`` per dtype and an ``index_put_`` into the table."""
    if len(dsts) != 6 or len(srcs) != 6:
        raise ValueError(f"copy_decode_inputs copies six fields, got {len(dsts)} destinations and {len(srcs)} "
                         f"sources")
    if table is not None and (table.dim() != 2 or table.stride(1) != 1):
        raise ValueError(f"copy_decode_inputs writes a row-major 2-D request table, got shape {tuple(table.shape)} "
                         f"with strides {table.stride()}")
    n = srcs[0].numel()
    if n and kernels_usable(srcs[0]) and all(t.is_contiguous() for t in (*dsts, *srcs)):
        tokens = feed.tokens if feed is not None and feed.tokens.numel() else None
        args = [t for pair in zip(dsts, srcs) for t in pair]
        launch(
            _copy_decode_kernel, (triton.cdiv(n, COPY_BLOCK),), *args, tokens if tokens is not None else srcs[0],
            table if table is not None else srcs[4], n,
            0 if tokens is None else tokens.numel(), (feed.vocab_size or 0) if tokens is not None else 0,
            0 if table is None else table.stride(0), FEED=tokens is not None,
            HAS_VOCAB=tokens is not None and bool(feed.vocab_size), TABLE=table is not None, BLOCK=COPY_BLOCK)
        return
    if feed is not None:
        feed.apply(srcs[0])
    torch._foreach_copy_(list(dsts[:4]), list(srcs[:4]))
    torch._foreach_copy_(list(dsts[4:]), list(srcs[4:]))
    if table is not None and n:
        table[srcs[3], srcs[1]] = srcs[2].to(table.dtype)


def warm_up(device: torch.device, vocab_size: int | None) -> None:
    """Build every kernel variant a step can launch on ``device`` (the feed alone, the decode copy with and without
    a feed and with and without the table write; int64 tokens, the engine's vocabulary known or not), so that first
    traffic compiles nothing."""
    if device.type != "cuda" or triton is None:
        return
    table = torch.zeros(1, 2, dtype=torch.int32, device=device)
    for vocab in {vocab_size, None}:
        ids = torch.tensor([-1, 0], dtype=torch.int64, device=device)
        tokens = torch.zeros(1, dtype=torch.int64, device=device)
        feed_tokens(ids, tokens, vocab)
        longs = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(8)]
        ints = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(4)]
        for feed in (TokenFeed(tokens, vocab), None):
            for write in (table, None):
                copy_decode_inputs(longs[:4] + ints[:2], longs[4:] + ints[2:], feed, write)
