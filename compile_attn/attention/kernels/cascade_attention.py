"""Shared-prefix (cascade) decode attention: a prefix that many decode requests share is read once per query block.

Level 1 (``_shared_prefix_kernel``) treats a group's requests as one extend without a causal mask: for one KV head,
the query rows are (request, query head of that KV head's group) pairs of every request in the group, so each KV
tile of the shared prefix is loaded once per ``BLOCK_M`` rows instead of once per request. The prefix may be cut
into ``num_prefix_splits`` tile-aligned chunks (more programs for small groups); each (row, split) writes a
normalised fp32 partial output and its base-2 log-sum-exp. Level 2 (``_own_merge_kernel``) is one program per
(request, KV head, head block) over the request's own KV (positions ``prefix_len .. seq_len - 1``); it folds the
level-1 partials of its rows into its online softmax and writes the final output. With ``split_levels`` the two
levels are independent (level 2 writes its own partial, ``_merge_kernel`` combines them afterwards), so level 1
(compute-bound) can run on a side stream next to level 2 (memory-bound). No host sync and no allocation when the
caller passes the scratch: capturable in a CUDA graph at fixed sizes.

Both levels read an fp8 cache (float32 ``k_scale``/``v_scale`` per KV head) as fp8, converted to the query's dtype
in registers; ``k_scale`` joins ``sm_scale`` on the scores and each program multiplies its accumulated output by
``v_scale`` once, before its partial is written or folded.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from compile_attn.attention.kernels._common import (
    check_device,
    check_kv_scales,
    check_last_dim_contiguous,
    dot_precision,
    fp8_kv_query,
    mma,
    next_pow2,
    softcap,
)
from compile_attn.attention.kernels.cascade_index import CascadeIndex
from compile_attn.attention.kernels.decode_attention import _split_kernel_config
from compile_attn.attention.kernels.launch import CachedLaunch
from compile_attn.ops.triton_launch import is_interpreted

# Level-1 programs aimed at per SM when choosing the number of prefix splits (two resident blocks per SM).
PREFIX_PROGRAMS_PER_SM = 2
MAX_PREFIX_SPLITS = 8


@triton.jit
def _prefix_tile(q, k, v, mask_n, m_i, l_i, acc, sm_scale, logit_cap,
                 MASKED: tl.constexpr, HAS_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr):
    """One online-softmax step (base 2) over a prefix KV tile; ``MASKED``: keys where ``mask_n`` is False are out.
    A masked tile holds at least one key, so every row's running maximum stays finite. ``KV_FP8``: the tiles are
    fp8 (converted here, exactly; ``sm_scale`` then includes the KV head's ``k_scale``)."""
    if KV_FP8:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    qk = mma(q, tl.trans(k), DOT_PRECISION)
    if HAS_CAP:
        qk = softcap(qk * sm_scale, logit_cap) * 1.4426950408889634
    else:
        qk = qk * (sm_scale * 1.4426950408889634)
    if MASKED:
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p, v, DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _shared_prefix_kernel(
    Q,
    K_Buf,
    V_Buf,
    Prefix_Indptr,
    Prefix_Indices,
    Group_Indptr,
    Group_Reqs,
    Part_Out,
    Part_Lse,
    K_Scale,
    V_Scale,
    sm_scale,
    logit_cap,
    split_len,
    num_splits,
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
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    HAS_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # Programs next to each other in dimension 0 read the same KV tiles (same head, split and group): L2 hits.
    m_block = tl.program_id(0)
    kv_head = tl.program_id(1) // num_splits
    split = tl.program_id(1) % num_splits
    grp = tl.program_id(2)
    req_lo = tl.load(Group_Indptr + grp)
    num_rows = (tl.load(Group_Indptr + grp + 1) - req_lo) * GROUP
    p_lo = tl.load(Prefix_Indptr + grp)
    prefix_len = tl.load(Prefix_Indptr + grp + 1) - p_lo
    lo = split * split_len
    hi = tl.minimum(lo + split_len, prefix_len)
    row_lo = m_block * BLOCK_M
    if (row_lo < num_rows) & (lo < hi):
        offs_m = row_lo + tl.arange(0, BLOCK_M)
        mask_m = offs_m < num_rows
        req = tl.load(Group_Reqs + req_lo + offs_m // GROUP, mask=mask_m, other=0).to(tl.int64)
        head = kv_head * GROUP + offs_m % GROUP
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_dv = offs_dv < V_HEAD_DIM
        q = tl.load(Q + req[:, None] * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)
        qk_scale = sm_scale
        if KV_FP8:
            qk_scale = sm_scale * tl.load(K_Scale + kv_head)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        index_base = Prefix_Indices + p_lo
        k_base = K_Buf + kv_head * stride_kh + offs_d[None, :]
        v_base = V_Buf + kv_head * stride_vh + offs_dv[None, :]
        full_hi = lo + (hi - lo) // BLOCK_N * BLOCK_N
        for start in range(lo, full_hi, BLOCK_N):  # whole tiles: no key mask (nor a column mask unless padded)
            offs_n = start + tl.arange(0, BLOCK_N)
            slots = tl.load(index_base + offs_n).to(tl.int64)
            if BLOCK_D == HEAD_DIM:
                k = tl.load(k_base + slots[:, None] * stride_kt)
            else:
                k = tl.load(k_base + slots[:, None] * stride_kt, mask=mask_d[None, :], other=0.0)
            if BLOCK_DV == V_HEAD_DIM:
                v = tl.load(v_base + slots[:, None] * stride_vt)
            else:
                v = tl.load(v_base + slots[:, None] * stride_vt, mask=mask_dv[None, :], other=0.0)
            m_i, l_i, acc = _prefix_tile(q, k, v, offs_n < hi, m_i, l_i, acc, qk_scale, logit_cap,
                                         False, HAS_CAP, DOT_PRECISION, KV_FP8)
        if full_hi < hi:  # the split's partial last tile
            offs_n = full_hi + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            slots = tl.load(index_base + offs_n, mask=mask_n, other=0).to(tl.int64)
            k = tl.load(k_base + slots[:, None] * stride_kt, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            v = tl.load(v_base + slots[:, None] * stride_vt, mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
            m_i, l_i, acc = _prefix_tile(q, k, v, mask_n, m_i, l_i, acc, qk_scale, logit_cap,
                                         True, HAS_CAP, DOT_PRECISION, KV_FP8)
        if KV_FP8:  # values summed as stored: once per program
            acc = acc * tl.load(V_Scale + kv_head)
        part_ptrs = Part_Out + req[:, None] * stride_pb + head[:, None] * stride_ph + split * stride_ps + offs_dv[None, :]
        tl.store(part_ptrs, acc / l_i[:, None], mask=mask_m[:, None] & mask_dv[None, :])
        tl.store(Part_Lse + req * stride_lb + head * stride_lh + split * stride_ls, m_i + tl.log2(l_i), mask=mask_m)


_LAUNCH_PREFIX = CachedLaunch(_shared_prefix_kernel)


@triton.jit
def _own_merge_kernel(
    Q,
    K_Buf,
    V_Buf,
    Own_Indptr,
    Own_Indices,
    Req_Prefix_Lens,
    Part_Out,
    Part_Lse,
    Out,
    K_Scale,
    V_Scale,
    sm_scale,
    logit_cap,
    split_len,
    own_slot,
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
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    H_BLOCKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    USE_DOT: tl.constexpr,
    HAS_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1) // H_BLOCKS
    offs_g = (tl.program_id(1) % H_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    offs_h = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < V_HEAD_DIM

    own_lo = tl.load(Own_Indptr + b)
    own_len = tl.load(Own_Indptr + b + 1) - own_lo
    q = tl.load(Q + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    qk_scale = sm_scale
    if KV_FP8:
        q = fp8_kv_query(q)  # the tiles convert to its dtype
        qk_scale = sm_scale * tl.load(K_Scale + kv_head)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for start in range(0, own_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < own_len
        slots = tl.load(Own_Indices + own_lo + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K_Buf + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        if USE_DOT:
            qk = mma(q, tl.trans(k), DOT_PRECISION)
        else:
            qk = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
        qk = qk * qk_scale
        if HAS_CAP:
            qk = softcap(qk, logit_cap)
        qk = tl.where(mask_n[None, :], qk * 1.4426950408889634, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_Buf + slots[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :],
                    mask=mask_n[:, None] & mask_dv[None, :], other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        if USE_DOT:
            pv = mma(p, v, DOT_PRECISION)
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if KV_FP8:  # values summed as stored: once per program, before the partials (real units) are folded in
        acc = acc * tl.load(V_Scale + kv_head)

    mask_out = mask_h[:, None] & mask_dv[None, :]
    if WRITE_PARTIAL:
        # Split levels: this is one more partial (slot own_slot), merged by _merge_kernel once level 1 is done too.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        tl.store(Part_Out + b * stride_pb + offs_h[:, None] * stride_ph + own_slot * stride_ps + offs_dv[None, :],
                 acc / l_safe[:, None], mask=mask_out)
        tl.store(Part_Lse + b * stride_lb + offs_h * stride_lh + own_slot * stride_ls,
                 tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=mask_h)
    else:
        _fold_and_store(Part_Out, Part_Lse, Out, b, offs_h, mask_h, offs_dv, mask_out, m_i, l_i, acc,
                        tl.cdiv(tl.load(Req_Prefix_Lens + b), split_len), stride_pb, stride_ph, stride_ps, stride_lb,
                        stride_lh, stride_ls, stride_ob, stride_oh)


@triton.jit
def _fold_and_store(Part_Out, Part_Lse, Out, b, offs_h, mask_h, offs_dv, mask_out, m_i, l_i, acc, num_valid,
                    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ls, stride_ob, stride_oh):
    """Fold partials ``0 .. num_valid - 1`` (each normalised, weight 2^lse) into the online-softmax state
    (``m_i``, ``l_i``, ``acc``) and store the result. Padding rows of the head block load lse 0 (not -inf) so their
    arithmetic stays finite; they are never stored. A state and partials that are all empty give zeros."""
    for s in range(0, num_valid):
        lse = tl.load(Part_Lse + b * stride_lb + offs_h * stride_lh + s * stride_ls, mask=mask_h, other=0.0)
        part = tl.load(Part_Out + b * stride_pb + offs_h[:, None] * stride_ph + s * stride_ps + offs_dv[None, :],
                       mask=mask_out, other=0.0)
        m_new = tl.maximum(m_i, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        w = tl.exp2(lse - m_safe)
        acc = acc * alpha[:, None] + w[:, None] * part
        l_i = l_i * alpha + w
        m_i = m_new
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(Out + b * stride_ob + offs_h[:, None] * stride_oh + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=mask_out)


_LAUNCH_OWN = CachedLaunch(_own_merge_kernel)


@triton.jit
def _merge_kernel(
    Part_Out,
    Part_Lse,
    Req_Prefix_Lens,
    Out,
    split_len,
    own_slot,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ls,
    stride_ob,
    stride_oh,
    BLOCK_H: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
):
    """Split levels' last launch: request b's own partial (slot ``own_slot``) merged with its prefix partials."""
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < NUM_HEADS
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_out = mask_h[:, None] & (offs_dv < V_HEAD_DIM)[None, :]
    m_i = tl.load(Part_Lse + b * stride_lb + offs_h * stride_lh + own_slot * stride_ls, mask=mask_h, other=0.0)
    acc = tl.load(Part_Out + b * stride_pb + offs_h[:, None] * stride_ph + own_slot * stride_ps + offs_dv[None, :],
                  mask=mask_out, other=0.0)
    l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)  # a normalised partial is a state with l = 1 at m = lse
    _fold_and_store(Part_Out, Part_Lse, Out, b, offs_h, mask_h, offs_dv, mask_out, m_i, l_i, acc,
                    tl.cdiv(tl.load(Req_Prefix_Lens + b), split_len), stride_pb, stride_ph, stride_ps, stride_lb,
                    stride_lh, stride_ls, stride_ob, stride_oh)


_LAUNCH_MERGE = CachedLaunch(_merge_kernel)


def default_prefix_config(head_dim: int, v_head_dim: int) -> dict:
    """Level-1 tiles and launch options: ``BLOCK_M`` query rows ((request, head) pairs) by ``BLOCK_N`` keys."""
    if is_interpreted(_shared_prefix_kernel):
        return {"BLOCK_M": 16, "BLOCK_N": 16}  # small tiles: the tests' short prefixes still take several
    widest = max(next_pow2(head_dim), next_pow2(v_head_dim))
    if widest <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    if widest <= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def prefix_split_plan(index: CascadeIndex, num_kv_heads: int, group: int, block_m: int, block_n: int,
                      num_prefix_splits: int | None, device: torch.device) -> tuple[int, int]:
    """(number of prefix splits, tokens per split): the given number, or enough splits for about
    ``PREFIX_PROGRAMS_PER_SM`` level-1 programs per SM (at most ``MAX_PREFIX_SPLITS``, none shorter than a tile).
    Split lengths are whole ``block_n`` tiles."""
    longest = max(index.max_prefix_len, 1)
    if num_prefix_splits is None:
        if device.type != "cuda":
            num_prefix_splits = 1
        else:
            programs = max(1, index.num_groups * num_kv_heads * triton.cdiv(index.max_group_size * group, block_m))
            wanted = max(1, PREFIX_PROGRAMS_PER_SM * _num_sms(device.index or 0) // programs)
            num_prefix_splits = min(wanted, MAX_PREFIX_SPLITS, triton.cdiv(longest, block_n))
    if num_prefix_splits <= 0:
        raise ValueError(f"num_prefix_splits must be positive, got {num_prefix_splits}")
    split_len = triton.cdiv(triton.cdiv(longest, num_prefix_splits), block_n) * block_n
    return triton.cdiv(longest, split_len), split_len


def cascade_scratch(batch_size: int, num_q_heads: int, v_head_dim: int, num_prefix_splits: int,
                    device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partials ``[B, Hq, splits + 1, Dv]`` and log-sum-exps ``[B, Hq, splits + 1]`` for
    ``cascade_decode_fwd`` with up to ``num_prefix_splits`` prefix splits (the last slot holds level 2's own
    partial when the levels run split)."""
    part_out = torch.empty(batch_size, num_q_heads, num_prefix_splits + 1, v_head_dim, dtype=torch.float32,
                           device=device)
    part_lse = torch.empty(batch_size, num_q_heads, num_prefix_splits + 1, dtype=torch.float32, device=device)
    return part_out, part_lse


def cascade_decode_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out: torch.Tensor,
    index: CascadeIndex,
    sm_scale: float,
    logit_cap: float = 0.0,
    *,
    num_prefix_splits: int | None = None,
    part_out: torch.Tensor | None = None,
    part_lse: torch.Tensor | None = None,
    prefix_config: dict | None = None,
    split_levels: bool = False,
    side_stream: torch.cuda.Stream | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Decode attention of ``q[B, Hq, D]`` into ``out[B, Hq, Dv]`` where groups of requests share a cached prefix.

    Request ``b`` attends to its group's prefix (``index.prefix_indices``, read once per query block of the group)
    and to its own slots (``index.own_indices``); the result equals plain decode over the concatenation. Requests
    in no group attend to their own slots only. The step's new K/V must already be in the cache (``store_kv``).
    ``part_out``/``part_lse``: scratch from :func:`cascade_scratch` for at least the splits used (allocated here
    when omitted; pass them, and ``num_prefix_splits``, for CUDA-graph capture). ``prefix_config`` overrides
    level 1's tiles and launch options (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``; benchmarks).

    ``split_levels``: level 2 writes its own partial instead of merging, and a third launch merges, so that the
    two levels do not depend on each other; with ``side_stream`` (CUDA) level 1 runs there, concurrently with
    level 2 (compute-bound next to memory-bound), forked from and joined back into the current stream (CUDA-graph
    capturable).

    An fp8 cache needs its float32 ``k_scale``/``v_scale`` ``[Hkv]`` (stored = real / scale).
    """
    check_device(_shared_prefix_kernel, q, k_buffer, v_buffer, out, index.prefix_indices, index.own_indices)
    bs, num_q_heads, head_dim = q.shape
    _, num_kv_heads, k_dim = k_buffer.shape
    v_head_dim = v_buffer.shape[-1]
    if k_dim != head_dim or v_buffer.shape[1] != num_kv_heads or num_q_heads % num_kv_heads:
        raise ValueError(f"k_buffer {tuple(k_buffer.shape)} / v_buffer {tuple(v_buffer.shape)} do not match q "
                         f"{tuple(q.shape)} (query heads must be a multiple of the KV heads)")
    if tuple(out.shape) != (bs, num_q_heads, v_head_dim):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(bs, num_q_heads, v_head_dim)}")
    if index.batch_size != bs:
        raise ValueError(f"the cascade index was built for {index.batch_size} requests but q holds {bs}; rebuild it "
                         f"with build_cascade_index for this batch")
    if side_stream is not None and not split_levels:
        raise ValueError("side_stream runs level 1 next to level 2, which needs split_levels=True")
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("out", out)):
        check_last_dim_contiguous(name, t)
    fp8 = check_kv_scales(k_buffer, v_buffer, k_scale, v_scale)
    if bs == 0:
        return
    group = num_q_heads // num_kv_heads
    scales = (k_scale, v_scale) if fp8 else (q, q)  # unread placeholders for an unquantised cache
    config = {**default_prefix_config(head_dim, v_head_dim), **(prefix_config or {})}
    splits, split_len = prefix_split_plan(index, num_kv_heads, group, config["BLOCK_M"], config["BLOCK_N"],
                                          num_prefix_splits, q.device)
    slots = splits + 1 if split_levels else splits
    allocated = part_out is None or part_lse is None
    if allocated:
        part_out, part_lse = cascade_scratch(bs, num_q_heads, v_head_dim, splits, q.device)
    if (part_out.shape[0] < bs or part_out.shape[1] != num_q_heads or part_out.shape[2] < slots
            or part_out.shape[3] != v_head_dim or part_lse.shape[0] < bs or part_lse.shape[2] < slots):
        raise ValueError(f"part_out {tuple(part_out.shape)} / part_lse {tuple(part_lse.shape)} are too small for "
                         f"batch {bs}, {num_q_heads} heads, {slots} partials per head, v_head_dim {v_head_dim}; "
                         f"allocate them with cascade_scratch")
    check_last_dim_contiguous("part_out", part_out)
    block_d, block_dv = next_pow2(head_dim), next_pow2(v_head_dim)
    common = dict(BLOCK_D=block_d, BLOCK_DV=block_dv, HEAD_DIM=head_dim, V_HEAD_DIM=v_head_dim, HAS_CAP=logit_cap > 0,
                  KV_FP8=fp8)
    ps, ls = part_out.stride(), part_lse.stride()

    def level1() -> None:
        if index.num_groups and index.max_prefix_len:
            grid = (triton.cdiv(index.max_group_size * group, config["BLOCK_M"]), num_kv_heads * splits,
                    index.num_groups)
            _LAUNCH_PREFIX(
                grid, q, k_buffer, v_buffer, index.prefix_indptr, index.prefix_indices, index.group_indptr,
                index.group_reqs, part_out, part_lse, *scales, float(sm_scale), float(logit_cap), split_len, splits,
                *q.stride()[:2], *k_buffer.stride()[:2], *v_buffer.stride()[:2], *ps[:3], *ls[:3],
                GROUP=group, DOT_PRECISION=dot_precision(_shared_prefix_kernel, q.dtype), **common, **config,
            )

    use_dot = group > 1
    block_h = min(64, max(16, next_pow2(group))) if use_dot else 1
    h_blocks = triton.cdiv(group, block_h)
    own_config = _split_kernel_config(block_d, block_dv, use_dot, small_batch=False, kv_fp8=fp8)

    def level2() -> None:
        _LAUNCH_OWN(
            (bs, num_kv_heads * h_blocks), q, k_buffer, v_buffer, index.own_indptr, index.own_indices,
            index.req_prefix_lens, part_out, part_lse, out, *scales, float(sm_scale), float(logit_cap), split_len,
            splits,
            *q.stride()[:2], *k_buffer.stride()[:2], *v_buffer.stride()[:2], *ps[:3], *ls[:3], *out.stride()[:2],
            GROUP=group, BLOCK_H=block_h, H_BLOCKS=h_blocks, USE_DOT=use_dot,
            DOT_PRECISION=dot_precision(_own_merge_kernel, q.dtype), WRITE_PARTIAL=split_levels, **common,
            **own_config,
        )

    if not split_levels:
        level1()
        level2()
        return
    if side_stream is None or not q.is_cuda:
        level1()
        level2()
    else:
        main = torch.cuda.current_stream(q.device)
        side_stream.wait_stream(main)  # q and the cache's new K/V are ready
        if allocated:
            part_out.record_stream(side_stream)
            part_lse.record_stream(side_stream)
        with torch.cuda.stream(side_stream):
            level1()
        level2()
        main.wait_stream(side_stream)
    merge_h = min(16, next_pow2(num_q_heads))
    _LAUNCH_MERGE(
        (bs, triton.cdiv(num_q_heads, merge_h)), part_out, part_lse, index.req_prefix_lens, out, split_len, splits,
        *ps[:3], *ls[:3], *out.stride()[:2], BLOCK_H=merge_h, NUM_HEADS=num_q_heads, BLOCK_DV=block_dv,
        V_HEAD_DIM=v_head_dim, num_warps=4,
    )
