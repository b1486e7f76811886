"""The Triton matrix-vector kernel behind ``torch.ops.compile_attn.gemv`` (a linear layer of one input row).

At one token a linear layer reads its whole weight to produce one row, so its time is the weight's bytes over the
memory bandwidth the kernel sustains. Program ``p`` computes outputs ``p * BLOCK_N ... + BLOCK_N`` of
``y = W @ x (+ b)``: it walks K in ``BLOCK_K`` steps, multiplying a ``BLOCK_N x BLOCK_K`` tile of the weight by the
matching slice of ``x`` into an fp32 accumulator of the tile's shape, and sums it over K once at the end (one
rounding to the output dtype, as cuBLAS accumulates bf16 products in fp32). The weight is streamed once
(``evict_first``); ``x`` stays in cache for every program.

``gemv_config`` picks the tile (``benchmarks/sweep_gemv.py`` measured the choices, docs/performance.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from compile_attn.ops.triton_launch import launch


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


def gemv_config(n: int, k: int) -> GemvConfig:
    """The tile for an ``n x k`` weight: one output per program, K in steps of up to 512 values (1 KB of bf16), four
    warps, no software pipelining. Of the 72 tiles of ``benchmarks/sweep_gemv.py`` on an H200 (one decoder layer's
    linears and the LM head of the Llama-3.2-1B shape and of the Llama-3.1-8B shape at 1, 2 and 4 ranks) this one
    summed to within 1% of the per-shape best and was never more than 17% slower on any shape; the widest-first
    choice it replaced was up to 12% slower on the large weights (docs/performance.md)."""
    del n  # one output per program whatever the rows: thousands of programs for every layer of these models
    return GemvConfig(block_n=1, block_k=min(512, triton.next_power_of_2(k)), num_warps=4, num_stages=1)


def launch_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                config: GemvConfig | None = None) -> torch.Tensor:
    """``out[n] = weight[n, :] . x (+ bias[n])`` for a one-row ``x`` of ``k`` contiguous values, ``weight`` of
    shape ``[n, k]`` with unit stride along k. ``config`` overrides the tile ``gemv_config`` would choose."""
    n, k = weight.shape
    config = config or gemv_config(n, k)
    grid = (triton.cdiv(n, config.block_n),)
    launch(
        _gemv_kernel, grid, x, weight, bias if bias is not None else out, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
