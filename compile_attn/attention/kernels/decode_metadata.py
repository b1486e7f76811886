"""A decode step's whole Triton metadata in one launch: window starts, token CSR and KV split counts.

``build_decode_metadata`` computes what ``build_kv_indptr``, ``build_kv_indices`` and
``compute_num_kv_splits`` compute together (plus the sliding-window starts), with the same results, in
one kernel instead of about fifteen small torch ops and Triton launches. Program ``b`` loads every
request's length (the batch fits one block), takes its own offset as the sum of the lengths before it,
and copies its slots. Inside a decode CUDA graph that is ~14 fewer kernels per step; between piecewise
graphs (metadata built eagerly each step) ~14 fewer launches of host time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compile_attn.attention.kernels._common import check_device, next_pow2
from compile_attn.attention.kernels.decode_attention import (
    DEFAULT_SPLIT_SIZE,
    PROGRAMS_PER_SM,
    check_split_options,
    compute_num_kv_splits,
)
from compile_attn.attention.kernels.kv_index import build_kv_indices, build_kv_indptr, check_req_to_token, copy_slots
from compile_attn.attention.kernels.launch import CachedLaunch

MAX_BATCH = 4096  # larger batches are rare and take the three-call path (each program loads every length)
MIN_BLOCK_B = 256  # every batch up to this size shares one compiled kernel


def batch_block(bs: int) -> int:
    """The kernel's block over requests: one size for every batch up to ``MIN_BLOCK_B`` (the default decode
    buckets), so capturing them compiles the kernel once instead of once per bucket size, each compile adding
    to the cold start."""
    return max(MIN_BLOCK_B, next_pow2(bs))


# Not specialised on the alignment of the small per-request arrays (slices at any offset in mixed steps) nor on the
# batch size: one compiled variant per block size, built while graphs are captured, none mid-serving.
@triton.jit(do_not_specialize=["batch_size"],
            do_not_specialize_on_alignment=["Req_Pool_Indices", "Seq_Lens", "Kv_Start", "Kv_Indptr", "Kv_Indices",
                                            "Num_Kv_Splits"])
def _decode_metadata_kernel(
    Req_To_Token,
    Req_Pool_Indices,
    Seq_Lens,
    Kv_Start,
    Kv_Indptr,
    Kv_Indices,
    Num_Kv_Splits,
    batch_size,
    stride_req,
    window,
    target_programs,
    num_kv_heads,
    split_size,
    max_kv_splits,
    HAS_WINDOW: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK_B)
    seq = tl.maximum(tl.load(Seq_Lens + offs, mask=offs < batch_size, other=0).to(tl.int64), 0)
    if HAS_WINDOW:
        starts = tl.maximum(seq - window, 0)
    else:
        starts = tl.zeros_like(seq)
    lens = seq - starts
    before = tl.sum(tl.where(offs < b, lens, 0))
    length = tl.sum(tl.where(offs == b, lens, 0))
    start = tl.sum(tl.where(offs == b, starts, 0))
    if b == 0:
        tl.store(Kv_Indptr, 0)
    tl.store(Kv_Indptr + b + 1, (before + length).to(tl.int32))
    if HAS_WINDOW:
        tl.store(Kv_Start + b, start.to(tl.int32))
    if DETERMINISTIC:
        splits = (length + split_size - 1) // split_size
    else:
        work = tl.sum(lens) * num_kv_heads
        per_split = tl.maximum((work + target_programs - 1) // target_programs, split_size)
        splits = (length + per_split - 1) // per_split
    splits = tl.minimum(tl.maximum(splits, 1), max_kv_splits)
    tl.store(Num_Kv_Splits + b, splits.to(tl.int32))

    row = tl.load(Req_Pool_Indices + b).to(tl.int64)
    copy_slots(Req_To_Token + row * stride_req + start, Kv_Indices + before, length, BLOCK)


_LAUNCH_DECODE_METADATA = CachedLaunch(_decode_metadata_kernel)


def build_decode_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_kv_splits: torch.Tensor,
    *,
    num_sms: int,
    max_kv_splits: int,
    deterministic: bool = False,
    split_size: int = DEFAULT_SPLIT_SIZE,
    num_kv_heads: int = 1,
    window: int | None = None,
    kv_start: torch.Tensor | None = None,
    programs_per_sm: int | None = None,
) -> None:
    """Fill one decode step's metadata for ``bs = len(seq_lens)`` requests, on the device, no host sync.

    With a sliding ``window``, ``kv_start[b] = max(seq_lens[b] - window, 0)`` (written into ``kv_start``,
    which must then be given); request b reads positions ``kv_start[b]`` (else 0) to ``seq_lens[b] - 1``.
    ``kv_indptr[: bs + 1]`` gets the prefix sums of those lengths, ``kv_indices`` the slots from
    ``req_to_token`` (it must hold ``sum`` of them), ``num_kv_splits[:bs]`` what
    :func:`compute_num_kv_splits` gives for the lengths. Batches over ``MAX_BATCH`` requests run those three
    functions instead.
    """
    if (window is None) != (kv_start is None):
        raise ValueError(f"a sliding window needs a kv_start buffer and kv_start needs a window; got window={window!r} "
                         f"and kv_start {'given' if kv_start is not None else 'None'}")
    check_split_options(split_size, max_kv_splits)
    check_req_to_token(req_to_token)
    bs = seq_lens.shape[0]
    if bs == 0:
        kv_indptr[:1].zero_()
        return
    if bs > MAX_BATCH:
        lens = seq_lens
        if kv_start is not None:
            kv_start.copy_((seq_lens - window).clamp_(min=0))
            lens = seq_lens - kv_start
        build_kv_indptr(seq_lens, kv_indptr, kv_start)
        build_kv_indices(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices, kv_start)
        compute_num_kv_splits(lens, num_sms, max_kv_splits, deterministic, split_size, num_kv_heads=num_kv_heads,
                              out=num_kv_splits, programs_per_sm=programs_per_sm)
        return
    check_device(_decode_metadata_kernel, req_to_token, kv_indices)
    _LAUNCH_DECODE_METADATA(
        (bs,),
        req_to_token,
        req_pool_indices,
        seq_lens,
        kv_start if kv_start is not None else seq_lens,
        kv_indptr,
        kv_indices,
        num_kv_splits,
        bs,
        req_to_token.stride(0),
        window or 0,
        max(1, num_sms * (PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm)),
        num_kv_heads,
        split_size,
        max_kv_splits,
        HAS_WINDOW=window is not None,
        DETERMINISTIC=deterministic,
        BLOCK_B=batch_block(bs),
        BLOCK=512,
    )
