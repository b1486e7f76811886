"""Paged decode attention (one query token per request, or a chain verify step's few) over a token-level KV cache.

Stage 1 splits each request's KV range into ``num_kv_splits[b]`` tile-aligned chunks; one program
handles one (request, KV head, split) and all query heads of that KV head's group, so every KV tile
is read once (``tl.dot`` with the group padded to 16 rows when the group has more than one head).
It writes a normalised partial output and its base-2 log-sum-exp. Stage 2 merges the partials.

Given the step's new K/V (``k_new``/``v_new``), stage 1 also does the K/V store: the program whose split
holds a request's last position takes that token's K/V from ``k_new``/``v_new`` instead of the cache and
writes them to their slot (no ``store_kv`` before it).

Given ``semaphores`` (an int32 counter per request and head block, zero between launches), stage 2 runs inside
stage 1 and a decode layer is one launch: a request with one non-empty split writes its output directly; with
more, each split program stores its partial, then counts itself in with an atomic add (release/acquire), and the
last one to arrive merges the partials in split order and sets the counter back to zero. Nobody waits on anyone,
and the merge order does not depend on which program came last, so the result is deterministic. Without them
stage 2 is its own launch.

A chain verify step (``tokens_per_request`` Q > 1, the ``Q_PER_REQ`` constexpr) runs as decode of the requests with
Q query tokens each, their K/V already in the cache: a program's rows are the request's tokens x the group's heads,
so a KV tile is read once per request for all its tokens, and token t sees the request's first ``seq_len - Q + 1 + t``
keys. A row whose keys end before a split takes no part in it (no partial; the merge skips it). A draft tree's verify
step (``tree_mask``, the ``HAS_TREE_MASK`` constexpr) adds a per-row bitmask over the request's last Q keys: a token
sees the prefix, its ancestors and itself (a row's last key is still its own, so the split bookkeeping is the chain's).

An fp8 cache (``k_scale``/``v_scale``: float32 per KV head, stored = real / scale) is read as fp8 and converted
to the query's dtype in registers (exact: fp8 values are bf16/fp16 values); the scales cost nothing per element:
``k_scale[head]`` joins ``sm_scale`` on the scores, and ``v_scale[head]`` multiplies each program's accumulated
output once. The fused store quantises the new token (``quantize_fp8``), which is attended as stored.

On NVIDIA GPUs of compute capability 9.0+ the one-launch kernel is a programmatic dependent launch (PDL; off
with ``COMPILE_ATTN_PDL=0``): it waits for the kernel before it in its first instruction and lets the next one
start once its KV loop is done, so the launch gaps on both sides of each decode layer overlap the neighbouring
kernels, as between Inductor's kernels compiled with ``triton.enable_pdl``.

Every shape is fixed by ``max_kv_splits`` and the batch size, and nothing here syncs with the host
or allocates: the launches can be recorded in a CUDA graph and replayed with new index contents.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from compile_attn.attention.kernels._common import (
    FP8_KV_DTYPES,
    check_device,
    check_kv_scales,
    check_last_dim_contiguous,
    dot_precision,
    fp8_kv_query,
    kv_fp8_constexprs,
    mma,
    next_pow2,
    quantize_fp8,
    softcap,
)
from compile_attn.attention.kernels.decode_checks import (
    check_decode_shapes,
    check_new_tokens,
    check_semaphores,
    check_tree_mask,
)
from compile_attn.attention.kernels.launch import BoundLaunch, CachedLaunch
from compile_attn.ops.triton_launch import is_interpreted, pdl_supported

# Split boundaries are multiples of this many tokens; every stage-1 BLOCK_N divides it.
SPLIT_ALIGN = 64
DEFAULT_SPLIT_SIZE = 64  # swept with benchmarks/sweep_triton_decode.py: faster than 128 at small batches
DEFAULT_MAX_KV_SPLITS = 16
# compute_num_kv_splits aims for about this many stage-1 programs per SM.
PROGRAMS_PER_SM = 4
# Over an fp8 cache a program's tile costs half the bytes: twice the programs keep as many bytes in flight (measured:
# 64 x 4096 tokens, 151 -> 121 us; sweep_triton_decode.py --kv-dtype fp8_e4m3).
FP8_PROGRAMS_PER_SM = 8
# Batches of at most this many requests take stage-1 tiles of their own (``_split_kernel_config``) unless the
# caller asks for batch-invariant tiles.
SMALL_BATCH = 32


@triton.jit
def _split_len(seq_len, num_splits, max_kv_splits, ALIGN: tl.constexpr):
    """Tokens per split (a multiple of ALIGN); 0 when seq_len is 0. Shared by both stages."""
    n = tl.minimum(tl.maximum(num_splits, 1), max_kv_splits)
    return tl.cdiv(tl.cdiv(seq_len, n), ALIGN) * ALIGN


@triton.jit
def _decode_split_kernel(
    Q,
    K_Buf,
    V_Buf,
    Kv_Indptr,
    Kv_Indices,
    Num_Kv_Splits,
    Part_Out,
    Part_Lse,
    K_New,
    V_New,
    New_Loc,
    Out,
    Semaphores,
    K_Scale,
    V_Scale,
    Tree_Mask,
    sm_scale,
    logit_cap,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ls,
    stride_knb,
    stride_knh,
    stride_vnb,
    stride_vnh,
    stride_ob,
    stride_oh,
    stride_sem,
    max_kv_splits,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    H_BLOCKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FUSE_NEW: tl.constexpr,
    STORE_NEW: tl.constexpr,
    FUSE_MERGE: tl.constexpr,
    USE_PDL: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_EMULATE: tl.constexpr,
    Q_PER_REQ: tl.constexpr,
    HAS_TREE_MASK: tl.constexpr,
):
    if USE_PDL:
        # A programmatic dependent launch starts while the kernel before it finishes: wait for that kernel (and,
        # since every kernel waits before it lets its dependents start, all before it) before reading anything.
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0).to(tl.int64)  # the request
    kv_head = tl.program_id(1) // H_BLOCKS
    # Row r of the head block is the request's token r // GROUP and query head r % GROUP of the KV head's group.
    offs_r = (tl.program_id(1) % H_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    mask_h = offs_r < Q_PER_REQ * GROUP
    tok = offs_r // GROUP
    offs_h = kv_head * GROUP + offs_r % GROUP
    rows = b * Q_PER_REQ + tok  # rows of q, out and the scratch
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_HEAD_DIM

    kv_lo = tl.load(Kv_Indptr + b)
    seq_len = tl.load(Kv_Indptr + b + 1) - kv_lo
    split_len = _split_len(seq_len, tl.load(Num_Kv_Splits + b), max_kv_splits, SPLIT_ALIGN)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    # Keys each row sees: all of them in decode; token t of Q_PER_REQ sees seq_len - Q_PER_REQ + 1 + t (causal).
    row_len = seq_len - (Q_PER_REQ - 1) + tok
    if HAS_TREE_MASK:  # a draft tree: of the last Q_PER_REQ keys a row sees those its bits name (ancestors, itself)
        tree_bits = tl.load(Tree_Mask + rows, mask=mask_h, other=0).to(tl.int64)
        draft_lo = seq_len - Q_PER_REQ
    # FUSE_NEW: the split holding the last position (the step's new token) reads that token from K_New/V_New.
    has_new = (hi == seq_len) & (hi > lo)
    hi_cache = hi
    if FUSE_NEW:
        hi_cache = tl.where(has_new, hi - 1, hi)

    q = tl.load(
        Q + rows[:, None] * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    qk_scale = sm_scale
    if KV_FP8:  # scores of stored keys times k_scale are the real keys' scores
        k_scale = tl.load(K_Scale + kv_head)
        q = fp8_kv_query(q)  # the tiles convert to its dtype
        qk_scale = sm_scale * k_scale
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    index_base = Kv_Indices + kv_lo
    for start in range(lo, hi_cache, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi_cache
        slots = tl.load(index_base + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(
            K_Buf + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        if KV_FP8:
            k = k.to(q.dtype)  # exact (fp16 or fp32): the dot then runs as over an unquantised cache
        if USE_DOT:
            qk = mma(q, tl.trans(k), DOT_PRECISION)
        else:
            qk = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
        qk = qk * qk_scale
        if HAS_CAP:
            qk = softcap(qk, logit_cap)
        if Q_PER_REQ > 1:
            mask_qk = mask_n[None, :] & (offs_n[None, :] < row_len[:, None])
        else:
            mask_qk = mask_n[None, :]
        if HAS_TREE_MASK:
            draft_j = offs_n - draft_lo  # the key's index among the request's draft-region keys (< 0: the prefix)
            seen = ((tree_bits[:, None] >> tl.maximum(draft_j, 0).to(tl.int64)[None, :]) & 1) != 0
            mask_qk = mask_qk & ((draft_j < 0)[None, :] | seen)
        qk = tl.where(mask_qk, qk * 1.4426950408889634, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = m_new
        if Q_PER_REQ > 1:  # a row may have seen no key yet (its keys end before this tile): weights 0, not NaN
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(qk - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V_Buf + slots[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :],
            mask=mask_n[:, None] & mask_dv[None, :],
            other=0.0,
        )
        if KV_FP8:
            v = v.to(q.dtype)
        if USE_DOT:
            pv = mma(p, v, DOT_PRECISION)
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if USE_PDL:
        # The next kernel may start now; it waits for this whole grid to finish before it reads the output.
        tl.extra.cuda.gdc_launch_dependents()

    if FUSE_NEW:
        if has_new:
            # Rounded to the cache dtype first (quantised for an fp8 cache): the token is attended as it will be stored.
            k_new = tl.load(K_New + b * stride_knb + kv_head * stride_knh + offs_d, mask=mask_d, other=0.0)
            v_new = tl.load(V_New + b * stride_vnb + kv_head * stride_vnh + offs_dv, mask=mask_dv, other=0.0)
            if KV_FP8:
                k_new = quantize_fp8(k_new, k_scale, FP8_MAX, FP8_EMULATE)
                v_new = quantize_fp8(v_new, tl.load(V_Scale + kv_head), FP8_MAX, FP8_EMULATE)
            k_new = k_new.to(K_Buf.dtype.element_ty)
            v_new = v_new.to(V_Buf.dtype.element_ty)
            qk_new = tl.sum(q.to(tl.float32) * k_new[None, :].to(tl.float32), 1) * qk_scale
            if HAS_CAP:
                qk_new = softcap(qk_new, logit_cap)
            qk_new = qk_new * 1.4426950408889634
            m_new = tl.maximum(m_i, qk_new)
            alpha = tl.exp2(m_i - m_new)
            p_new = tl.exp2(qk_new - m_new)
            l_i = l_i * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * v_new[None, :].to(tl.float32)
            m_i = m_new
            if STORE_NEW:
                if tl.program_id(1) % H_BLOCKS == 0:  # one head block per KV head writes the token
                    slot = tl.load(New_Loc + b).to(tl.int64)
                    tl.store(K_Buf + slot * stride_kt + kv_head * stride_kh + offs_d, k_new, mask=mask_d)
                    tl.store(V_Buf + slot * stride_vt + kv_head * stride_vh + offs_dv, v_new, mask=mask_dv)

    if KV_FP8:  # the values were summed as stored: once per program, not per element
        acc = acc * tl.load(V_Scale + kv_head)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    part_ptrs = (Part_Out + rows[:, None] * stride_pb + offs_h[:, None] * stride_ph + split * stride_ps
                 + offs_dv[None, :])
    lse_ptrs = Part_Lse + rows * stride_lb + offs_h * stride_lh + split * stride_ls
    # A row's splits are those holding one of its keys (a prefix of the request's): the others write nothing and
    # stage 2 skips them. Empty splits (past the end of the request, or seq_len 0) hold no row's keys.
    has_keys = mask_h & (row_len > lo)
    row_splits = tl.cdiv(tl.maximum(row_len, 0), tl.maximum(split_len, 1))
    if FUSE_MERGE:
        num_valid = tl.cdiv(seq_len, tl.maximum(split_len, 1))
        mask_out = mask_h[:, None] & mask_dv[None, :]
        if num_valid <= 1:
            # One split (or no KV: zeros): its normalised output is the answer; no partials, no counter.
            if split == 0:
                out_ptrs = Out + rows[:, None] * stride_ob + offs_h[:, None] * stride_oh + offs_dv[None, :]
                tl.store(out_ptrs, (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=mask_out)
        elif split < num_valid:
            tl.store(part_ptrs, acc / l_safe[:, None], mask=has_keys[:, None] & mask_dv[None, :])
            tl.store(lse_ptrs, m_i + tl.log2(l_safe), mask=has_keys)
            tl.debug_barrier()  # every thread's partial is written before the release below
            counter = Semaphores + b * stride_sem + tl.program_id(1)
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_valid - 1:
                tl.store(counter, 0)  # ready for the next launch (or graph replay)
                _merge_partials(Part_Out, Part_Lse, Out, rows, offs_h, mask_h, row_splits, offs_dv, mask_out,
                                num_valid, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ls, stride_ob,
                                stride_oh, BLOCK_H, BLOCK_DV)
    else:
        tl.store(part_ptrs, acc / l_safe[:, None], mask=has_keys[:, None] & mask_dv[None, :])
        tl.store(lse_ptrs, m_i + tl.log2(l_safe), mask=has_keys)


@triton.jit
def _merge_partials(Part_Out, Part_Lse, Out, rows, offs_h, mask_h, row_splits, offs_dv, mask_out, num_valid,
                    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ls, stride_ob, stride_oh,
                    BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Stage 2 for one request and head block inside stage 1 (the last split program to finish): combine the
    ``num_valid`` (>= 2) partials in split order, each row's first ``row_splits`` only (the splits holding its keys;
    padding rows none). Loads go to L2 (``.cg``): other programs wrote them."""
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for s in range(0, num_valid):
        has = mask_h & (s < row_splits)  # a row's splits come first: once one is missing, the rest are
        lse = tl.load(Part_Lse + rows * stride_lb + offs_h * stride_lh + s * stride_ls, mask=has,
                      other=float("-inf"), cache_modifier=".cg")
        part = tl.load(Part_Out + rows[:, None] * stride_pb + offs_h[:, None] * stride_ph + s * stride_ps
                       + offs_dv[None, :], mask=has[:, None] & mask_out, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no split yet: weight 0, not NaN
        alpha = tl.exp2(m - m_ref)
        w = tl.exp2(lse - m_ref)
        acc = acc * alpha[:, None] + w[:, None] * part
        l_sum = l_sum * alpha + w
        m = m_new
    out = tl.where(l_sum[:, None] > 0, acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None], 0.0)  # no keys: zeros
    tl.store(Out + rows[:, None] * stride_ob + offs_h[:, None] * stride_oh + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=mask_out)


_LAUNCH_SPLIT = CachedLaunch(_decode_split_kernel)


@triton.jit
def _decode_merge_kernel(
    Part_Out,
    Part_Lse,
    Out,
    Kv_Indptr,
    Num_Kv_Splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ls,
    stride_ob,
    stride_oh,
    max_kv_splits,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
    Q_PER_REQ: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // Q_PER_REQ  # the request
    h = tl.program_id(1)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_HEAD_DIM

    seq_len = tl.load(Kv_Indptr + b + 1) - tl.load(Kv_Indptr + b)
    split_len = _split_len(seq_len, tl.load(Num_Kv_Splits + b), max_kv_splits, SPLIT_ALIGN)
    row_len = seq_len - (Q_PER_REQ - 1 - row % Q_PER_REQ)  # the keys this row sees (all of them in decode)
    num_valid = tl.cdiv(tl.maximum(row_len, 0), tl.maximum(split_len, 1))  # the splits holding them

    part_base = Part_Out + row * stride_pb + h * stride_ph
    lse_base = Part_Lse + row * stride_lb + h * stride_lh
    m = tl.full([], float("-inf"), tl.float32)
    l_sum = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for s0 in range(0, num_valid, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mask_s = offs_s < num_valid
        lse = tl.load(lse_base + offs_s * stride_ls, mask=mask_s, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        part = tl.load(
            part_base + offs_s[:, None] * stride_ps + offs_dv[None, :],
            mask=mask_s[:, None] & mask_dv[None, :],
            other=0.0,
        )
        acc = acc * alpha + tl.sum(w[:, None] * part, 0)
        l_sum = l_sum * alpha + tl.sum(w, 0)
        m = m_new
    # A row with no KV (seq_len 0) gets zeros, not NaN.
    out = tl.where(l_sum > 0, acc / tl.where(l_sum > 0, l_sum, 1.0), 0.0)
    tl.store(Out + row * stride_ob + h * stride_oh + offs_dv, out.to(Out.dtype.element_ty), mask=mask_dv)


_LAUNCH_MERGE = CachedLaunch(_decode_merge_kernel)


def _split_kernel_config(block_d: int, block_dv: int, use_dot: bool, small_batch: bool = False,
                         kv_fp8: bool = False) -> dict:
    """Tile sizes for stage 1, from the head dims and grouping, the cache's element size and, unless the caller
    asks for batch-invariant tiles (deterministic mode: a request's result must not change with batch
    composition), whether the batch has at most ``SMALL_BATCH`` requests.

    The values are the winners of ``benchmarks/sweep_triton_decode.py`` per head dim, warps and stages, and of
    its ``--tiles-only`` sweep per batch size (numbers in benchmarks/RESULTS.md and docs/performance.md).
    """
    if is_interpreted(_decode_split_kernel):
        return {"BLOCK_N": 32}  # the interpreter's per-op cost favours few, large tiles
    widest = max(block_d, block_dv)
    if kv_fp8:
        return _fp8_split_kernel_config(widest, use_dot, small_batch)
    if not use_dot:
        return {"BLOCK_N": 32 if widest <= 128 else 16, "num_warps": 4, "num_stages": 3}
    if widest <= 64:
        return {"BLOCK_N": 64 if small_batch else 32, "num_warps": 2, "num_stages": 2}
    return {"BLOCK_N": 64 if widest == 128 else 32, "num_warps": 4, "num_stages": 3}


def _fp8_split_kernel_config(widest: int, use_dot: bool, small_batch: bool) -> dict:
    """Stage-1 tiles over an fp8 cache: twice the bf16 tile's keys where that stays within ``SPLIT_ALIGN``, so that a
    tile loads as many bytes as bf16's (the bytes in flight per program, which hide the memory latency, stay the
    same while each key costs half); where the keys cannot double (small batches, head dim 128), one more pipeline
    stage instead. Chosen by reasoning, not measured: ``sweep_triton_decode.py --kv-dtype fp8_e4m3`` confirms or
    replaces them."""
    if not use_dot:
        return {"BLOCK_N": 64 if widest <= 128 else 32, "num_warps": 4, "num_stages": 3}
    if widest <= 64:  # 3 stages measured faster than 2 at 64 and 256 x 4096 tokens (480 vs 519 us at 256)
        return {"BLOCK_N": 64, "num_warps": 2, "num_stages": 3}
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4}


@functools.lru_cache(maxsize=256)
def _launch_meta(
    num_q_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int, dtype: torch.dtype, max_kv_splits: int,
    has_cap: bool, pdl: bool, small_batch: bool = False, kv_dtype: torch.dtype | None = None,
    tokens_per_request: int = 1,
) -> tuple[int, dict, dict]:
    """(head blocks per KV head, stage-1 constexprs and options, stage-2 ones): a function of the shapes only,
    computed once per shape (decode runs once per layer per step)."""
    group = num_q_heads // num_kv_heads
    rows = group * tokens_per_request  # a KV head's query rows per request: tokens x heads
    use_dot = rows > 1
    block_h = min(64, max(16, next_pow2(rows))) if use_dot else 1
    h_blocks = triton.cdiv(rows, block_h)
    block_d, block_dv = next_pow2(head_dim), next_pow2(v_head_dim)
    tiles = _split_kernel_config(block_d, block_dv, use_dot, small_batch, kv_dtype in FP8_KV_DTYPES)
    if tokens_per_request > 1 and block_h > 16 and tiles.get("num_warps", 4) < 4:
        tiles["num_warps"] = 4  # 32-64 rows of scores and output per program: more registers than 2 warps hold
    split = dict(
        GROUP=group, BLOCK_H=block_h, H_BLOCKS=h_blocks, BLOCK_D=block_d, BLOCK_DV=block_dv, HEAD_DIM=head_dim,
        V_HEAD_DIM=v_head_dim, SPLIT_ALIGN=SPLIT_ALIGN, USE_DOT=use_dot, HAS_CAP=has_cap,
        DOT_PRECISION=dot_precision(_decode_split_kernel, dtype),
        **kv_fp8_constexprs(_decode_split_kernel, kv_dtype or dtype), Q_PER_REQ=tokens_per_request, **tiles,
    )
    if pdl:
        split["launch_pdl"] = True
    merge = dict(
        V_HEAD_DIM=v_head_dim, BLOCK_DV=block_dv, BLOCK_S=min(next_pow2(max_kv_splits), 16), SPLIT_ALIGN=SPLIT_ALIGN,
        Q_PER_REQ=tokens_per_request, num_warps=2 if block_dv <= 128 else 4,
    )
    return h_blocks, split, merge


def _use_pdl(q: torch.Tensor) -> bool:
    """Whether the split kernel launches as a programmatic dependent launch for ``q``'s device."""
    return q.is_cuda and not is_interpreted(_decode_split_kernel) and pdl_supported(q.device.index)


def decode_semaphores(batch_size: int, num_q_heads: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed counters for :func:`decode_attention_fwd`'s one-launch mode, for up to ``batch_size`` query rows."""
    return torch.zeros(batch_size, num_q_heads, dtype=torch.int32, device=device)


def check_split_options(split_size: int, max_kv_splits: int) -> None:
    """The split-count options of :func:`compute_num_kv_splits` (and the decode metadata kernel) must be positive."""
    if split_size <= 0 or max_kv_splits <= 0:
        raise ValueError(f"split_size and max_kv_splits must be positive, got {split_size}, {max_kv_splits}")


def compute_num_kv_splits(
    seq_lens: torch.Tensor,
    num_sms: int,
    max_kv_splits: int,
    deterministic: bool = False,
    split_size: int = DEFAULT_SPLIT_SIZE,
    *,
    num_kv_heads: int = 1,
    out: torch.Tensor | None = None,
    programs_per_sm: int | None = None,
) -> torch.Tensor:
    """Per-request number of KV splits for :func:`decode_attention_fwd`, as int32 on seq_lens' device.

    Device ops only (no host sync), so it can be recorded in a CUDA graph; with ``out`` the result
    is copied into that static buffer. ``deterministic=True``: ``ceil(seq_len / split_size)``
    splits, a function of the request's own length, so its output bits do not depend on the rest
    of the batch. Otherwise the batch's total work (``sum(seq_lens) * num_kv_heads``) is spread
    over about ``programs_per_sm * num_sms`` stage-1 programs (default ``PROGRAMS_PER_SM``; the triton backend
    passes ``FP8_PROGRAMS_PER_SM`` over an fp8 cache), with no split shorter than
    ``split_size`` tokens. Both are clamped to ``[1, max_kv_splits]``.
    """
    check_split_options(split_size, max_kv_splits)
    lens = seq_lens.to(torch.int64).clamp_min(0)
    if deterministic:
        splits = (lens + (split_size - 1)) // split_size
    else:
        target = max(1, num_sms * (PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm))
        work = lens.sum() * num_kv_heads
        tokens_per_split = ((work + (target - 1)) // target).clamp_min(split_size)
        splits = (lens + tokens_per_split - 1) // tokens_per_split
    splits = splits.clamp(1, max_kv_splits).to(torch.int32)
    if out is None:
        return splits
    out.copy_(splits)
    return out


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_kv_splits: torch.Tensor,
    max_kv_splits: int,
    attn_logits: torch.Tensor,
    attn_lse: torch.Tensor,
    sm_scale: float,
    logit_cap: float = 0.0,
    *,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    new_loc: torch.Tensor | None = None,
    semaphores: torch.Tensor | None = None,
    batch_invariant: bool = False,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tokens_per_request: int = 1,
    tree_mask: torch.Tensor | None = None,
) -> None:
    """Decode attention of ``q[B, Hq, D]`` over the cache into ``out[B, Hq, Dv]``.

    Request ``b`` reads slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` of ``k_buffer[S, Hkv, D]``
    and ``v_buffer[S, Hkv, Dv]``. ``attn_logits[B, Hq, max_kv_splits, Dv]`` and
    ``attn_lse[B, Hq, max_kv_splits]`` (fp32) are caller-owned scratch. ``num_kv_splits[b]`` is
    clamped to ``[1, max_kv_splits]`` inside the kernels. ``logit_cap > 0`` applies
    ``cap * tanh(s / cap)`` to the scaled scores. A request with no KV gets zeros.

    With ``k_new[>=B, Hkv, D]`` / ``v_new[>=B, Hkv, Dv]`` (the step's new token per request), each
    request's last position is that token: it is taken from ``k_new``/``v_new`` (cast to the cache
    dtype), not read from the cache, and with ``new_loc[>=B]`` it is also stored at slot ``new_loc[b]``
    (``store_kv`` fused in). Requests with no KV take nothing from them.

    With ``semaphores`` (int32 ``[>= B, >= Hq]``, zero-filled, e.g. from :func:`decode_semaphores`) the merge of
    the splits runs inside the split kernel: one launch instead of two. The kernel leaves them zero again;
    two launches must not share one buffer at the same time (one per stream, as the scratch).

    Batches of up to ``SMALL_BATCH`` requests run with larger KV tiles than bigger ones (faster there), so a
    request's output bits can change with the batch size; ``batch_invariant=True`` keeps one tile size for every
    batch (with ``compute_num_kv_splits(deterministic=True)``: bitwise the same output in any batch).

    An fp8 cache (``float8_e4m3fn``/``float8_e5m2``) needs its float32 ``k_scale``/``v_scale`` ``[Hkv]`` (stored =
    real / scale), read on the device at launch time (graph replays see their current values); the fused store
    quantises the new token as ``store_kv`` does, and the request attends to it as stored.

    ``tokens_per_request=Q > 1`` (a chain verify step): ``q``/``out`` hold ``B * Q`` rows, request ``b``'s tokens at
    rows ``b*Q .. b*Q+Q-1`` in position order, while ``kv_indptr``/``kv_indices``/``num_kv_splits`` describe the
    ``B`` requests, whose KV already holds all ``Q`` tokens (stored before: no ``k_new``/``v_new``/``new_loc``).
    Token ``t`` attends to its request's first ``seq_len - Q + 1 + t`` keys (causal; none: zeros). One program reads
    each KV tile once for all ``Q`` tokens x the GQA group (at most 64 rows). ``attn_logits``/``attn_lse``/
    ``semaphores`` are per query row, as in decode with ``B * Q`` rows. ``tokens_per_request=1`` is decode.

    ``tree_mask`` (int64 ``[>= B * Q]``, the verify mode only: a draft tree verify step): bit ``j`` of row ``b*Q + t``
    says whether token ``t`` sees request ``b``'s draft-region key ``j`` (its key ``seq_len - Q + j``; its ancestors and
    itself, ``draft_tree``); keys before the draft region are seen by every token, keys after ``t`` by none. Without
    it (chains) the kernel is the one without the mask (the ``HAS_TREE_MASK`` constexpr off).
    """
    for launch, grid, args, kwargs in _decode_launches(
        q, k_buffer, v_buffer, out, kv_indptr, kv_indices, num_kv_splits, max_kv_splits, attn_logits, attn_lse,
        sm_scale, logit_cap, k_new=k_new, v_new=v_new, new_loc=new_loc, semaphores=semaphores,
        batch_invariant=batch_invariant, k_scale=k_scale, v_scale=v_scale, tokens_per_request=tokens_per_request,
        tree_mask=tree_mask,
    ):
        launch(grid, *args, **kwargs)


def decode_attention_fwd_and_bind(*args: Any, **kwargs: Any) -> Callable[[], bool] | None:
    """:func:`decode_attention_fwd` (same arguments), returning the same launch bound for repeats (or None where
    it cannot be).

    The returned ``again()`` launches exactly this decode again, skipping the argument checks and the launch
    keys: only for a caller that knows the next call would pass the same tensors (same addresses, shapes,
    strides, dtypes) and scalars, e.g. a decode layer between piecewise graphs, whose inputs are a graph's
    static outputs and the backend's static metadata buffers. It reads the buffers' current contents, holds no tensor, and returns False
    without launching while a launch hook (a profiler) is active; then call :func:`decode_attention_fwd`. None:
    the kernels are interpreted, or this Triton's launch form is not the one mirrored (see ``launch``).
    """
    bound = []
    for launch, grid, launch_args, launch_kwargs in _decode_launches(*args, **kwargs):
        launch(grid, *launch_args, **launch_kwargs)
        bound.append(launch.bind(grid, *launch_args, **launch_kwargs))
    if any(b is None for b in bound):
        return None
    if len(bound) == 1:
        return bound[0]
    return functools.partial(_launch_bound, tuple(bound))


def _launch_bound(bound: tuple[BoundLaunch, ...]) -> bool:
    return all([launch() for launch in bound])  # a list: every launch runs (or, with a hook active, none does)


def _decode_launches(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_kv_splits: torch.Tensor,
    max_kv_splits: int,
    attn_logits: torch.Tensor,
    attn_lse: torch.Tensor,
    sm_scale: float,
    logit_cap: float = 0.0,
    *,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    new_loc: torch.Tensor | None = None,
    semaphores: torch.Tensor | None = None,
    batch_invariant: bool = False,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tokens_per_request: int = 1,
    tree_mask: torch.Tensor | None = None,
) -> list[tuple[CachedLaunch, tuple, tuple, dict]]:
    """The checked launches (launcher, grid, positional and keyword arguments) of one decode_attention_fwd."""
    check_device(_decode_split_kernel, q, k_buffer, v_buffer, out, kv_indptr, kv_indices)
    bs = check_decode_shapes(q, k_buffer, v_buffer, out, attn_logits, attn_lse, max_kv_splits, tokens_per_request)
    num_rows, num_q_heads, head_dim = q.shape
    num_kv_heads, v_head_dim = k_buffer.shape[1], v_buffer.shape[-1]
    # Strides read once per tensor: this runs once per layer per step, on the host's critical path.
    qs, ks, vs, os_, ls, lses = q.stride(), k_buffer.stride(), v_buffer.stride(), out.stride(), attn_logits.stride(), \
        attn_lse.stride()
    if qs[-1] != 1 or ks[-1] != 1 or vs[-1] != 1 or os_[-1] != 1 or ls[-1] != 1:
        for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("out", out),
                        ("attn_logits", attn_logits)):
            check_last_dim_contiguous(name, t)  # raises, naming the tensor
    fuse_new = k_new is not None or v_new is not None or new_loc is not None
    new_strides = (0, 0, 0, 0)
    if fuse_new:
        check_new_tokens(k_new, v_new, new_loc, bs, num_kv_heads, head_dim, v_head_dim, tokens_per_request)
        check_device(_decode_split_kernel, k_new, v_new, new_loc)
        if k_new.stride(-1) != 1 or v_new.stride(-1) != 1:
            check_last_dim_contiguous("k_new", k_new)
            check_last_dim_contiguous("v_new", v_new)
        new_strides = (*k_new.stride()[:2], *v_new.stride()[:2])
    if semaphores is not None:
        check_semaphores(semaphores, num_rows, num_q_heads, q.device)
    fp8 = check_kv_scales(k_buffer, v_buffer, k_scale, v_scale)
    if tree_mask is not None:
        check_tree_mask(tree_mask, num_rows, q.device)
    if bs == 0:
        return []

    fuse_merge = semaphores is not None
    # PDL for the one-launch form only: the two-launch form's merge kernel would wait on the split kernel anyway
    pdl = fuse_merge and _use_pdl(q)
    h_blocks, split_meta, merge_meta = _launch_meta(num_q_heads, num_kv_heads, head_dim, v_head_dim, q.dtype,
                                                    max_kv_splits, logit_cap > 0, pdl,
                                                    not batch_invariant and bs <= SMALL_BATCH, k_buffer.dtype,
                                                    tokens_per_request)
    split_args = (
        q,
        k_buffer,
        v_buffer,
        kv_indptr,
        kv_indices,
        num_kv_splits,
        attn_logits,
        attn_lse,
        k_new if fuse_new else q,  # unread placeholders when FUSE_NEW is off
        v_new if fuse_new else q,
        new_loc if new_loc is not None else kv_indptr,
        out,
        semaphores if fuse_merge else kv_indptr,  # unread placeholder when FUSE_MERGE is off
        k_scale if fp8 else kv_indptr,  # unread placeholders for an unquantised cache
        v_scale if fp8 else kv_indptr,
        tree_mask if tree_mask is not None else kv_indptr,  # unread placeholder for chains
        float(sm_scale),
        float(logit_cap),
        *qs[:2],
        *ks[:2],
        *vs[:2],
        *ls[:3],
        *lses[:3],
        *new_strides,
        *os_[:2],
        semaphores.stride(0) if fuse_merge else 0,
        max_kv_splits,
    )
    split_kwargs = dict(FUSE_NEW=fuse_new, STORE_NEW=new_loc is not None, FUSE_MERGE=fuse_merge, USE_PDL=pdl,
                        HAS_TREE_MASK=tree_mask is not None, **split_meta)
    launches = [(_LAUNCH_SPLIT, (bs, num_kv_heads * h_blocks, max_kv_splits), split_args, split_kwargs)]
    if fuse_merge:
        return launches
    merge_args = (
        attn_logits,
        attn_lse,
        out,
        kv_indptr,
        num_kv_splits,
        *ls[:3],
        *lses[:3],
        *os_[:2],
        max_kv_splits,
    )
    launches.append((_LAUNCH_MERGE, (num_rows, num_q_heads), merge_args, merge_meta))
    return launches
