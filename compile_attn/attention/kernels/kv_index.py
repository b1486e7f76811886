"""KV-cache index kernels: build the token CSR (``kv_indptr``/``kv_indices``) and the page ids of a
page-level CSR from ``req_to_token`` on the device, and write new K/V into the cache at their slots (an fp8 cache
stores them divided by its per-head scales, saturated: ``_common.quantize_fp8``).

Each only reads device tensors and writes into caller-owned buffers: no host sync, no allocation, so
they can be recorded in a CUDA graph when the buffers are static.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from compile_attn.attention.kernels._common import (
    check_device,
    check_kv_scales,
    kv_fp8_constexprs,
    next_pow2,
    quantize_fp8,
)
from compile_attn.attention.kernels.launch import CachedLaunch


def check_req_to_token(req_to_token: torch.Tensor) -> None:
    """The index kernels read a request's slots as one contiguous run of its ``req_to_token`` row."""
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must be contiguous along its position dimension")


@triton.jit
def copy_slots(src, dst, n, BLOCK: tl.constexpr):
    """``dst[:n] = src[:n]`` in blocks: one request's slots from its ``req_to_token`` row into ``kv_indices``."""
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


# The index arrays are often slices at any offset (a mixed step's decode rows, a request's window start): no
# specialisation on their alignment, so one compiled variant serves every step and none is built mid-serving.
@triton.jit(do_not_specialize_on_alignment=["Req_Pool_Indices", "Seq_Lens", "Kv_Start", "Kv_Indptr", "Kv_Indices"])
def _build_kv_indices_kernel(
    Req_To_Token,
    Req_Pool_Indices,
    Seq_Lens,
    Kv_Start,
    Kv_Indptr,
    Kv_Indices,
    stride_req,
    HAS_START: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(Req_Pool_Indices + b).to(tl.int64)
    end = tl.load(Seq_Lens + b).to(tl.int64)
    start = tl.zeros([], dtype=tl.int64)
    if HAS_START:
        start = tl.load(Kv_Start + b).to(tl.int64)
    out_lo = tl.load(Kv_Indptr + b).to(tl.int64)
    out_hi = tl.load(Kv_Indptr + b + 1).to(tl.int64)
    # Never write past this request's output range, whatever seq_lens says.
    n = tl.minimum(end - start, out_hi - out_lo)
    copy_slots(Req_To_Token + row * stride_req + start, Kv_Indices + out_lo, n, BLOCK)


_LAUNCH_BUILD_INDICES = CachedLaunch(_build_kv_indices_kernel)


def build_kv_indptr(
    seq_lens: torch.Tensor, out: torch.Tensor, kv_start: torch.Tensor | None = None
) -> torch.Tensor:
    """Fill ``out[B+1]`` with the exclusive prefix sum of ``seq_lens - kv_start`` (device ops only)."""
    lens = seq_lens if kv_start is None else seq_lens - kv_start
    out[:1].zero_()
    torch.cumsum(lens, dim=0, dtype=out.dtype, out=out[1:])
    return out


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices_out: torch.Tensor,
    kv_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write ``req_to_token[req_pool_indices[b], kv_start[b]:seq_lens[b]]`` into
    ``kv_indices_out[kv_indptr[b]:kv_indptr[b+1]]`` for every request ``b``.

    ``kv_indptr`` must already hold the matching prefix sums (see :func:`build_kv_indptr`);
    a request never writes outside its ``kv_indptr`` range. Returns ``kv_indices_out``.
    """
    check_device(_build_kv_indices_kernel, req_to_token, kv_indices_out)
    check_req_to_token(req_to_token)
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return kv_indices_out
    _LAUNCH_BUILD_INDICES(
        (bs,),
        req_to_token,
        req_pool_indices,
        seq_lens,
        kv_start if kv_start is not None else seq_lens,
        kv_indptr,
        kv_indices_out,
        req_to_token.stride(0),
        HAS_START=kv_start is not None,
        BLOCK=512,
    )
    return kv_indices_out


@triton.jit
def _build_page_indices_kernel(
    Req_To_Token,
    Req_Pool_Indices,
    Page_Indptr,
    Page_Indices,
    stride_req,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(Req_Pool_Indices + b).to(tl.int64)
    out_lo = tl.load(Page_Indptr + b).to(tl.int64)
    n = tl.load(Page_Indptr + b + 1).to(tl.int64) - out_lo
    src = Req_To_Token + row * stride_req
    if PAGE_SIZE == 1:
        copy_slots(src, Page_Indices + out_lo, n, BLOCK)
    else:  # page j begins at position j * PAGE_SIZE; its id is that slot // PAGE_SIZE
        for i in range(0, n, BLOCK):
            offs = i + tl.arange(0, BLOCK)
            mask = offs < n
            slot = tl.load(src + offs * PAGE_SIZE, mask=mask)
            tl.store(Page_Indices + out_lo + offs, slot // PAGE_SIZE, mask=mask)


_LAUNCH_BUILD_PAGE_INDICES = CachedLaunch(_build_page_indices_kernel)


def build_page_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    page_indptr: torch.Tensor,
    page_indices_out: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """The page-level CSR's ids (FlashInfer layout) in one launch: for every request ``b`` and page
    ``j < page_indptr[b+1] - page_indptr[b]``, ``page_indices_out[page_indptr[b] + j] =
    req_to_token[req_pool_indices[b], j * page_size] // page_size``.

    ``page_indptr`` (on the device) already holds the pages per request, so each request reads only the
    ``req_to_token`` entries of its own pages and writes only its own range; no host sync and no
    allocation, so it can be recorded in a CUDA graph whose buffers are static. Returns ``page_indices_out``.
    """
    check_device(_build_page_indices_kernel, req_to_token, req_pool_indices, page_indptr, page_indices_out)
    check_req_to_token(req_to_token)
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return page_indices_out
    _LAUNCH_BUILD_PAGE_INDICES(
        (bs,), req_to_token, req_pool_indices, page_indptr, page_indices_out, req_to_token.stride(0),
        PAGE_SIZE=page_size, BLOCK=512,
    )
    return page_indices_out


@triton.jit
def _store_kv_kernel(
    K_Buf,
    V_Buf,
    Loc,
    K,
    V,
    K_Scale,
    V_Scale,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    V_HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_EMULATE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_kv_heads
    slot = tl.load(Loc + t).to(tl.int64)

    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_h[:, None] & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    if KV_FP8:
        k = quantize_fp8(k, tl.load(K_Scale + offs_h, mask=mask_h, other=1.0)[:, None], FP8_MAX, FP8_EMULATE)
    tl.store(
        K_Buf + slot * stride_kbt + offs_h[:, None] * stride_kbh + offs_d[None, :],
        k.to(K_Buf.dtype.element_ty),
        mask=mask,
    )

    offs_dv = tl.arange(0, BLOCK_DV)
    mask_v = mask_h[:, None] & (offs_dv[None, :] < V_HEAD_DIM)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_dv[None, :], mask=mask_v)
    if KV_FP8:
        v = quantize_fp8(v, tl.load(V_Scale + offs_h, mask=mask_h, other=1.0)[:, None], FP8_MAX, FP8_EMULATE)
    tl.store(
        V_Buf + slot * stride_vbt + offs_h[:, None] * stride_vbh + offs_dv[None, :],
        v.to(V_Buf.dtype.element_ty),
        mask=mask_v,
    )


_LAUNCH_STORE_KV = CachedLaunch(_store_kv_kernel)


@functools.lru_cache(maxsize=64)
def _store_blocks(num_kv_heads: int, head_dim: int, v_head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_D, BLOCK_DV) of the K/V store: per shape, computed once (it runs once per layer per step)."""
    block_d, block_dv = next_pow2(head_dim), next_pow2(v_head_dim)
    return min(next_pow2(num_kv_heads), max(1, 4096 // max(block_d, block_dv))), block_d, block_dv


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """``k_buffer[loc] = k; v_buffer[loc] = v`` in one launch (casting to the cache dtype).

    An fp8 cache (``float8_e4m3fn``/``float8_e5m2``) needs its float32 ``k_scale``/``v_scale`` ``[num_kv_heads]``:
    it stores ``k / k_scale[head]`` saturated to the format's largest finite value, as ``kv/fp8.py``'s
    ``quantize`` does (the same bits: both round to nearest even). The scales are read on the device, so a
    captured launch stores with their values at replay.

    ``k``/``v`` may be strided views (e.g. slices of a fused QKV projection) as long as the last
    dimension is contiguous. Duplicate slots (padding tokens all writing scratch slot 0) are allowed;
    which of them lands is unspecified.
    """
    check_device(_store_kv_kernel, k_buffer, v_buffer, loc, k, v)
    num_tokens, num_kv_heads, head_dim = k.shape
    v_head_dim = v.shape[-1]
    if num_tokens == 0:
        return
    for name, t in (("k", k), ("v", v), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    fp8 = check_kv_scales(k_buffer, v_buffer, k_scale, v_scale)
    block_h, block_d, block_dv = _store_blocks(num_kv_heads, head_dim, v_head_dim)
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _LAUNCH_STORE_KV(
        grid,
        k_buffer,
        v_buffer,
        loc,
        k,
        v,
        k_scale if fp8 else loc,  # unread placeholders for an unquantised cache
        v_scale if fp8 else loc,
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        num_kv_heads,
        HEAD_DIM=head_dim,
        V_HEAD_DIM=v_head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        **_store_fp8_constexprs(k_buffer.dtype),
        num_warps=4,
    )


@functools.lru_cache(maxsize=8)
def _store_fp8_constexprs(kv_dtype: torch.dtype) -> dict:
    return kv_fp8_constexprs(_store_kv_kernel, kv_dtype)
