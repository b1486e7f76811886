"""Extend (prefill / chunked prefill / verification) attention over a cached prefix plus new tokens.

One program handles ``BLOCK_M`` new tokens of one request and one query head. It first streams the
request's cached prefix through ``kv_indices`` from the paged cache, then the request's new K/V
straight from the ``k``/``v`` inputs, with one online softmax over both. Masks are built from
absolute positions (prefix length + offset): causal, HF-style sliding window, or a per-request
custom mask (tree verification) that replaces the causal rule. A draft tree's mask may cover the new keys only
(every cached key is visible), and the new tokens' own positions (a tree's ``prefix + depth``) may be given for
the sliding window.
The grid depends on the host-known ``max_len_extend``: extend runs outside CUDA graphs.

An fp8 cache (float32 ``k_scale``/``v_scale`` per KV head) is read as fp8 and converted to the query's dtype in
registers; ``k_scale`` joins ``sm_scale`` on the prefix's scores and the accumulated output is multiplied by
``v_scale`` once, where the prefix ends. The new tokens are attended from ``k``/``v`` as given (unquantised).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from compile_attn.attention.kernels._common import (
    check_device,
    check_kv_scales,
    check_last_dim_contiguous,
    dot_precision,
    mma,
    next_pow2,
    softcap,
)
from compile_attn.attention.kernels.launch import CachedLaunch
from compile_attn.ops.triton_launch import is_interpreted


@triton.jit
def _attend_tile(
    q,
    k,
    v,
    allowed,
    m_i,
    l_i,
    acc,
    sm_scale,
    logit_cap,
    MASKED: tl.constexpr,
    HAS_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over a KV tile. ``MASKED``: apply ``allowed``, and rows with nothing
    allowed so far stay at zero; unmasked tiles are fully visible to every row."""
    qk = mma(q, tl.trans(k), DOT_PRECISION) * sm_scale
    if HAS_CAP:
        qk = softcap(qk, logit_cap)
    qk = qk * 1.4426950408889634
    if MASKED:
        qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p, v, DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _load_tile(ptrs, mask_rows, mask_cols, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """``tl.load`` of a ``[rows, cols]`` tile with only the masks that can be false."""
    if MASK_ROWS and MASK_COLS:
        tile = tl.load(ptrs, mask=mask_rows[:, None] & mask_cols[None, :], other=0.0)
    elif MASK_ROWS:
        tile = tl.load(ptrs, mask=mask_rows[:, None], other=0.0)
    elif MASK_COLS:
        tile = tl.load(ptrs, mask=mask_cols[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    K_Buf,
    V_Buf,
    Qo_Indptr,
    Kv_Indptr,
    Kv_Indices,
    Mask,
    Mask_Indptr,
    Positions,
    K_Scale,
    V_Scale,
    sm_scale,
    logit_cap,
    sliding_window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    GROUP: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_NEW_ONLY: tl.constexpr,
    HAS_POS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    tl.static_assert(BLOCK_M % BLOCK_N == 0, "causal tiles below the diagonal must end where a query block starts")
    head = tl.program_id(0)
    # Query blocks run last-first: under a causal mask the last blocks have the most keys to visit.
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)
    b = tl.program_id(2)
    kv_head = head // GROUP
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    PAD_DV: tl.constexpr = BLOCK_DV != V_HEAD_DIM
    # Window and custom masks decide per position, so every tile of the part they reach is masked; otherwise
    # only the last partial tile of each part and (causal) the tiles on the diagonal are. A mask over the new keys
    # only (MASK_NEW_ONLY: a draft tree's) leaves every cached key visible.
    PREFIX_MASKED: tl.constexpr = HAS_WINDOW or (HAS_MASK and not MASK_NEW_ONLY)
    NEW_MASKED: tl.constexpr = HAS_WINDOW or HAS_MASK

    q_lo = tl.load(Qo_Indptr + b).to(tl.int64)
    ext_len = tl.load(Qo_Indptr + b + 1) - q_lo
    kv_lo = tl.load(Kv_Indptr + b)
    prefix_len = tl.load(Kv_Indptr + b + 1) - kv_lo
    row_lo = m_block * BLOCK_M
    # Blocks past this request's new tokens run no loop iterations and store nothing.
    live = row_lo < ext_len

    offs_m = row_lo + tl.arange(0, BLOCK_M)
    mask_m = offs_m < ext_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_HEAD_DIM
    if HAS_POS:  # the window's positions of the new tokens (a draft tree's prefix + depth)
        q_pos = tl.load(Positions + q_lo + offs_m, mask=mask_m, other=0).to(tl.int32)
    else:
        q_pos = prefix_len + offs_m
    if HAS_MASK:
        # Row i of request b's mask: [prefix_len + ext_len] columns (cached keys, then new keys), or [ext_len]
        # columns (new keys only).
        if MASK_NEW_ONLY:
            mask_cols = ext_len
            mask_key0 = 0
        else:
            mask_cols = prefix_len + ext_len
            mask_key0 = prefix_len
        mask_row = Mask + tl.load(Mask_Indptr + b).to(tl.int64) + offs_m.to(tl.int64) * mask_cols

    q = tl.load(
        Q + (q_lo + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # Cached prefix: every prefix position precedes every new token, so only window / custom mask apply.
    prefix_qk_scale = sm_scale
    if KV_FP8:  # scores of stored keys times k_scale are the real keys' scores
        prefix_qk_scale = sm_scale * tl.load(K_Scale + kv_head)
    pre_lo = 0
    if HAS_WINDOW:
        if HAS_POS:  # the block's earliest position opens the earliest window
            q_first = tl.min(tl.where(mask_m, q_pos, prefix_len + ext_len), axis=0)
            pre_lo = tl.maximum(q_first - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
        else:
            pre_lo = tl.maximum(prefix_len + row_lo - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
    pre_hi = tl.where(live, prefix_len, 0)
    if PREFIX_MASKED:
        pre_full = pre_lo
    else:
        pre_full = pre_hi // BLOCK_N * BLOCK_N
    # Phase 0: whole tiles every row sees, no masks; phase 1: the rest, masked.
    for phase in tl.static_range(2):
        if phase == 0:
            lo = pre_lo
            hi = pre_full
        else:
            lo = pre_full
            hi = pre_hi
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < prefix_len
            if phase == 0:
                slots = tl.load(Kv_Indices + kv_lo + offs_n).to(tl.int64)
            else:
                slots = tl.load(Kv_Indices + kv_lo + offs_n, mask=mask_n, other=0).to(tl.int64)
            k = _load_tile(K_Buf + slots[:, None] * stride_kbt + kv_head * stride_kbh + offs_d[None, :],
                           mask_n, mask_d, phase == 1, PAD_D)
            v = _load_tile(V_Buf + slots[:, None] * stride_vbt + kv_head * stride_vbh + offs_dv[None, :],
                           mask_n, mask_dv, phase == 1, PAD_DV)
            if KV_FP8:  # exact; the dots then run as over an unquantised cache
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            allowed = mask_m[:, None] & mask_n[None, :]
            if HAS_WINDOW:
                allowed &= offs_n[None, :] > q_pos[:, None] - sliding_window
            if HAS_MASK and not MASK_NEW_ONLY:
                custom = tl.load(mask_row[:, None] + offs_n[None, :], mask=allowed, other=0)
                allowed &= custom != 0
            m_i, l_i, acc = _attend_tile(
                q, k, v, allowed, m_i, l_i, acc, prefix_qk_scale, logit_cap, phase == 1, HAS_CAP, DOT_PRECISION
            )
    if KV_FP8:  # the prefix's values were summed as stored; the new tokens' come in real units
        acc = acc * tl.load(V_Scale + kv_head)

    # New tokens, read from k/v directly.
    ext_start = 0
    if HAS_WINDOW and not HAS_POS:  # (given positions need not grow with the token index)
        ext_start = tl.maximum(row_lo - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
    ext_hi = ext_len
    if IS_CAUSAL:
        ext_hi = tl.minimum(ext_len, row_lo + BLOCK_M)
    ext_hi = tl.where(live, ext_hi, 0)
    if NEW_MASKED:
        ext_full = ext_start
    elif IS_CAUSAL:
        ext_full = tl.where(live, row_lo, 0)  # keys below this block's first row: visible to all its rows
    else:
        ext_full = ext_hi // BLOCK_N * BLOCK_N
    for phase in tl.static_range(2):
        if phase == 0:
            lo = ext_start
            hi = ext_full
        else:
            lo = ext_full
            hi = ext_hi
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < ext_len
            k = _load_tile(K + (q_lo + offs_n)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                           mask_n, mask_d, phase == 1, PAD_D)
            v = _load_tile(V + (q_lo + offs_n)[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :],
                           mask_n, mask_dv, phase == 1, PAD_DV)
            allowed = mask_m[:, None] & mask_n[None, :]
            if IS_CAUSAL:
                allowed &= offs_n[None, :] <= offs_m[:, None]
            if HAS_WINDOW:
                if HAS_POS:
                    k_pos = tl.load(Positions + q_lo + offs_n, mask=mask_n, other=0).to(tl.int32)
                else:
                    k_pos = prefix_len + offs_n
                allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
            if HAS_MASK:
                custom = tl.load(mask_row[:, None] + (mask_key0 + offs_n)[None, :], mask=allowed, other=0)
                allowed &= custom != 0
            m_i, l_i, acc = _attend_tile(
                q, k, v, allowed, m_i, l_i, acc, sm_scale, logit_cap, phase == 1, HAS_CAP, DOT_PRECISION
            )

    # A row that may attend to nothing (fully masked) gets zeros rather than NaN.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        Out + (q_lo + offs_m)[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_dv[None, :],
    )


_LAUNCH_EXTEND = CachedLaunch(_extend_kernel)


def _extend_config(block_d: int, block_dv: int) -> dict:
    if is_interpreted(_extend_kernel):
        # Interpreted (CPU tests): smaller tiles than on the GPU, so the short sequences of the
        # tests still cross several tile boundaries (and a query block's diagonal spans two key tiles).
        return {"BLOCK_M": 32, "BLOCK_N": 16}
    if max(block_d, block_dv) <= 128:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}


def build_mask_indptr(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor) -> torch.Tensor:
    """``[B+1]`` offsets of each request's ``[extend_len, prefix_len + extend_len]`` custom mask."""
    ext = qo_indptr[1:] - qo_indptr[:-1]
    sizes = ext * (kv_indptr[1:] - kv_indptr[:-1] + ext)
    indptr = torch.zeros(qo_indptr.shape[0], dtype=torch.int64, device=qo_indptr.device)
    torch.cumsum(sizes, dim=0, out=indptr[1:])
    return indptr


def extend_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    max_len_extend: int,
    sm_scale: float,
    is_causal: bool = True,
    sliding_window: int = -1,
    logit_cap: float = 0.0,
    custom_mask: torch.Tensor | None = None,
    mask_indptr: torch.Tensor | None = None,
    mask_new_keys_only: bool = False,
    positions: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Attention of new tokens ``q[T, Hq, D]`` over their request's cached prefix and themselves.

    Request ``b`` owns rows ``qo_indptr[b]:qo_indptr[b+1]`` of q/k/v/out (positions
    ``prefix_len_b + i``) and the prefix slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
    ``max_len_extend`` must be at least the longest request's new-token count (host-known).
    ``sliding_window > 0``: a query at position p sees keys j with ``p - sliding_window < j <= p``.
    ``custom_mask`` (bool/uint8, flattened ``[extend_len, prefix_len + extend_len]`` per request at
    ``mask_indptr[b]``; derived from the indptrs when ``mask_indptr`` is None) replaces the causal
    rule; a sliding window still applies on top of it. ``mask_new_keys_only``: the mask is ``[extend_len,
    extend_len]`` per request (new keys only; every cached key is visible); ``mask_indptr`` is then required.
    ``positions`` (``[T]`` ints): the new tokens' positions for the sliding window (a draft tree's ``prefix +
    depth``) instead of ``prefix_len + i``; a cached key's position is its index.
    An fp8 cache needs its float32 ``k_scale``/``v_scale`` ``[Hkv]`` (stored = real / scale); the new tokens are
    attended from ``k``/``v`` as given.
    """
    check_device(_extend_kernel, q, k, v, out, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask,
                 mask_indptr, positions)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    v_head_dim = v.shape[-1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if k.shape[-1] != head_dim or k_buffer.shape[1:] != k.shape[1:] or v_buffer.shape[1:] != v.shape[1:]:
        raise ValueError(
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, k_buffer {tuple(k_buffer.shape)}, "
            f"v_buffer {tuple(v_buffer.shape)} do not match q {tuple(q.shape)}"
        )
    if tuple(out.shape) != (num_tokens, num_q_heads, v_head_dim):
        raise ValueError(
            f"out has shape {tuple(out.shape)}, expected {(num_tokens, num_q_heads, v_head_dim)}"
        )
    for name, t in (
        ("q", q),
        ("k", k),
        ("v", v),
        ("out", out),
        ("k_buffer", k_buffer),
        ("v_buffer", v_buffer),
    ):
        check_last_dim_contiguous(name, t)
    fp8 = check_kv_scales(k_buffer, v_buffer, k_scale, v_scale)
    bs = qo_indptr.shape[0] - 1
    if bs <= 0 or num_tokens == 0 or max_len_extend <= 0:
        return

    has_mask = custom_mask is not None
    if has_mask:
        if custom_mask.dtype == torch.bool:
            custom_mask = custom_mask.view(torch.uint8)
        if mask_indptr is None:
            if mask_new_keys_only:
                raise ValueError("mask_new_keys_only needs mask_indptr (the offsets of each request's [n, n] mask)")
            mask_indptr = build_mask_indptr(qo_indptr, kv_indptr)
    has_pos = positions is not None and sliding_window > 0
    if has_pos and tuple(positions.shape) != (num_tokens,):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, expected ({num_tokens},): one per token")
    block_d, block_dv = next_pow2(head_dim), next_pow2(v_head_dim)
    cfg = _extend_config(block_d, block_dv)
    grid = (num_q_heads, triton.cdiv(max_len_extend, cfg["BLOCK_M"]), bs)
    _LAUNCH_EXTEND(
        grid,
        q,
        k,
        v,
        out,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        custom_mask if has_mask else qo_indptr,
        mask_indptr if has_mask else qo_indptr,
        positions if has_pos else qo_indptr,
        k_scale if fp8 else qo_indptr,  # unread placeholders for an unquantised cache
        v_scale if fp8 else qo_indptr,
        float(sm_scale),
        float(logit_cap),
        int(sliding_window),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        GROUP=num_q_heads // num_kv_heads,
        IS_CAUSAL=is_causal and not has_mask,
        HAS_WINDOW=sliding_window > 0,
        HAS_CAP=logit_cap > 0,
        HAS_MASK=has_mask,
        MASK_NEW_ONLY=has_mask and mask_new_keys_only,
        HAS_POS=has_pos,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        HEAD_DIM=head_dim,
        V_HEAD_DIM=v_head_dim,
        DOT_PRECISION=dot_precision(_extend_kernel, q.dtype),
        KV_FP8=fp8,
        **cfg,
    )
