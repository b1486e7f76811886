"""The Triton matrix-vector kernel behind ``torch.ops.compile_attn.gemv`` (a linear layer of one input row).

At one token a linear layer reads its whole weight to produce one row, so its time is the weight's bytes over the
memory bandwidth the kernel sustains. Program ``p`` computes outputs ``p * BLOCK_N ... + BLOCK_N`` of
``y = W @ x (+ b)``: it walks K in ``BLOCK_K`` steps, multiplying a ``BLOCK_N x BLOCK_K`` tile of the weight by the
matching slice of ``x`` into an fp32 accumulator of the tile's shape, and sums it over K once at the end (one
rounding to the output dtype, as cuBLAS accumulates bf16 products in fp32). The weight is streamed once
(``evict_first``); ``x`` stays in cache for every program.

``gemv_config`` picks the tile from the weight's shape (``benchmarks/sweep_gemv.py`` measured the choices,
docs/performance.md): enough programs to fill the GPU several times over, each with several KB in flight per step.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _gemv_kernel(
    X,
    W,
    B,
    Y,
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = X + offs_k
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs)
        else:
            mask_k = offs_k + k * BLOCK_K < K
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=mask_k, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(Y + offs_n, y.to(Y.dtype.element_ty), mask=mask_n)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def gemv_config(n: int, k: int, num_sms: int) -> GemvConfig:
    """The tile for an ``n x k`` weight on a GPU of ``num_sms`` SMs: ``BLOCK_K`` up to 512 (contiguous 1 KB reads of
    bf16 per row), and the widest ``BLOCK_N`` (up to 16) that still gives every SM at least four programs."""
    block_k = min(512, triton.next_power_of_2(k))
    block_n = 16
    while block_n > 1 and triton.cdiv(n, block_n) < 4 * num_sms:
        block_n //= 2
    return GemvConfig(block_n=block_n, block_k=block_k, num_warps=4, num_stages=1)


def launch_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                config: GemvConfig | None = None) -> torch.Tensor:
    """``out[n] = weight[n, :] . x (+ bias[n])`` for a one-row ``x`` of ``k`` contiguous values, ``weight`` of
    shape ``[n, k]`` with unit stride along k. ``config`` overrides the tile ``gemv_config`` would choose."""
    n, k = weight.shape
    if config is None:
        sms = _num_sms(x.device.index or 0) if x.is_cuda else 132
        config = gemv_config(n, k, sms)
    grid = (triton.cdiv(n, config.block_n),)
    _gemv_kernel[grid](
        x, weight, bias if bias is not None else out, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
