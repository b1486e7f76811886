"""How fast can a decode step's paged KV be read, by KV head or by token row? The question behind the bs-64 gap.

At 64 requests x 512 tokens (Llama-3.2-1B shape: 8 KV heads x head_dim 64, bf16, page size 1) the decode kernel
reads 64 MB per layer in ~32 us, 2.0 TB/s. Each of its programs handles one (request, KV head, split) and gathers
128-byte K and V rows 1 KB apart (the other heads of a token sit between them). This script times two kernels that
only read and sum the same bytes, no attention math: ``per_head`` (the decode kernel's access pattern) and
``per_token`` (a program per (request, split) reading each token's 1 KB row of all heads at once), over a grid of
tile sizes, warps and split counts, each as launches over copies of the KV (> 256 MB in all, at most 256)
back to back in one CUDA graph (``common.graph_us``: ``do_bench`` median, per launch). If the
token-row pattern reads at a clearly higher rate, a decode kernel that handles all KV heads of a request in one
program is worth writing; if both top out near the same rate, the gap is elsewhere (latency, tail, the merge).
Answered: both read at the same rate (docs/performance.md).

    python benchmarks/experiments/bench_kv_read_pattern.py --cases 64x512,256x512,16x512 --slots contiguous,shuffled
    TRITON_INTERPRET=1 python benchmarks/experiments/bench_kv_read_pattern.py --check   # the sums, on the CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from compile_attn.bench.decode_step import LLAMA_1B

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _split_bounds(Indptr, b, s, split_len):
    """(request b's first index entry, split s's first and end positions within the request)."""
    base = tl.load(Indptr + b)
    lo = s * split_len
    return base, lo, tl.minimum(lo + split_len, tl.load(Indptr + b + 1) - base)


@triton.jit
def _read_per_head(K, V, Indptr, Indices, Out, split_len, stride_t, num_heads, num_splits,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (request, KV head, split): the split's K and V rows of one head (HEAD_DIM elements each)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    base, lo, hi = _split_bounds(Indptr, b, s, split_len)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask = offs_n < hi
        slots = tl.load(Indices + base + offs_n, mask=mask, other=0).to(tl.int64)
        ptrs = slots[:, None] * stride_t + h * HEAD_DIM + offs_d[None, :]
        k = tl.load(K + ptrs, mask=mask[:, None], other=0.0)
        v = tl.load(V + ptrs, mask=mask[:, None], other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(Out + (b * num_heads + h) * num_splits + s, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _read_per_token(K, V, Indptr, Indices, Out, split_len, stride_t, num_splits,
                    ROW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (request, split): the split's whole K and V rows (all heads, ROW elements each)."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    base, lo, hi = _split_bounds(Indptr, b, s, split_len)
    offs_r = tl.arange(0, ROW)
    acc = tl.zeros([BLOCK_N, ROW], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask = offs_n < hi
        slots = tl.load(Indices + base + offs_n, mask=mask, other=0).to(tl.int64)
        ptrs = slots[:, None] * stride_t + offs_r[None, :]
        k = tl.load(K + ptrs, mask=mask[:, None], other=0.0)
        v = tl.load(V + ptrs, mask=mask[:, None], other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(Out + b * num_splits + s, tl.sum(tl.sum(acc, 1), 0))


def make_kv(bs: int, ctx: int, num_heads: int, head_dim: int, shuffled: bool, device: str, seed: int = 0,
            dtype: torch.dtype = torch.bfloat16) -> dict:
    """K/V pools of ``bs * ctx`` slots (+ scratch slot 0) and each request's ``ctx`` slots, in order or shuffled."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = bs * ctx + 1
    slots = torch.randperm(num_slots - 1, generator=gen) + 1 if shuffled else torch.arange(1, num_slots)
    dtype = torch.float32 if device == "cpu" else dtype  # the interpreter has no bf16 arithmetic
    return {
        "k": torch.randn(num_slots, num_heads, head_dim, generator=gen).to(device, dtype),
        "v": torch.randn(num_slots, num_heads, head_dim, generator=gen).to(device, dtype),
        "indptr": (torch.arange(bs + 1, dtype=torch.int32) * ctx).to(device),
        "indices": slots.to(torch.int32).to(device),
        "bs": bs, "ctx": ctx,
    }


def split_len(ctx: int, splits: int, block_n: int) -> int:
    """Tokens per split, a multiple of ``block_n`` (the decode kernel's rule)."""
    return triton.cdiv(triton.cdiv(ctx, splits), block_n) * block_n


def read(kv: dict, pattern: str, splits: int, block_n: int, num_warps: int) -> tuple[torch.Tensor, object]:
    """(output sums, a no-argument launch) of ``pattern`` over ``kv``."""
    k, v, bs = kv["k"], kv["v"], kv["bs"]
    _, num_heads, head_dim = k.shape
    length = split_len(kv["ctx"], splits, block_n)
    opts = {} if INTERPRETED else {"num_warps": num_warps, "num_stages": 2}
    if pattern == "per_head":
        out = torch.zeros(bs, num_heads, splits, device=k.device)

        def launch() -> None:
            _read_per_head[(bs, num_heads, splits)](k, v, kv["indptr"], kv["indices"], out, length, k.stride(0),
                                                    num_heads, splits, HEAD_DIM=head_dim, BLOCK_N=block_n, **opts)
    else:
        out = torch.zeros(bs, splits, device=k.device)

        def launch() -> None:
            _read_per_token[(bs, splits)](k, v, kv["indptr"], kv["indices"], out, length, k.stride(0), splits,
                                          ROW=num_heads * head_dim, BLOCK_N=block_n, **opts)
    return out, launch


def reference(kv: dict, pattern: str, splits: int, block_n: int) -> torch.Tensor:
    """The same sums in float64 with torch (gathering the slots)."""
    k, v, bs, ctx = kv["k"].double(), kv["v"].double(), kv["bs"], kv["ctx"]
    length = split_len(ctx, splits, block_n)
    rows = (k + v)[kv["indices"].long()].view(bs, ctx, k.shape[1], k.shape[2]).sum(-1)  # [bs, ctx, heads]
    out = torch.zeros(bs, rows.shape[2], splits, dtype=torch.float64)
    for s in range(splits):
        out[:, :, s] = rows[:, s * length:min((s + 1) * length, ctx)].sum(1).cpu()
    return out if pattern == "per_head" else out.sum(1)


def check() -> None:
    """Both kernels against the float64 sums, tiny sizes (runs under TRITON_INTERPRET on the CPU)."""
    device = "cpu" if INTERPRETED else "cuda"
    for shuffled, pattern, splits in itertools.product((False, True), ("per_head", "per_token"), (1, 3)):
        kv = make_kv(3, 37, 2, 16, shuffled, device, seed=splits)
        out, launch = read(kv, pattern, splits, 16, 2)
        launch()
        torch.testing.assert_close(out.double().cpu(), reference(kv, pattern, splits, 16), rtol=1e-4, atol=1e-3)
    print("ok: per_head and per_token sums match float64")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="64x512,256x512,16x512,64x4096")
    parser.add_argument("--slots", default="contiguous,shuffled")
    parser.add_argument("--heads", type=int, default=LLAMA_1B["num_key_value_heads"])
    parser.add_argument("--head-dim", type=int, default=LLAMA_1B["head_dim"])
    parser.add_argument("--check", action="store_true", help="only check the sums against torch (tiny sizes)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"), help="the cache's element type")
    parser.add_argument("--out", default="kv_read_pattern.json")
    args = parser.parse_args()
    if args.check:
        check()
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
    from common import PEAK_TB_S, graph_us, num_copies

    grid = {
        "per_head": list(itertools.product((1, 2, 4, 8, 16), (16, 32, 64, 128), (1, 2, 4))),
        "per_token": list(itertools.product((1, 2, 4, 8, 16, 32), (8, 16, 32), (2, 4, 8))),
    }
    results = []
    print("| bs x ctx | slots | MB (K+V) | per_head best us (TB/s) [splits, BLOCK_N, warps] | "
          "per_token best us (TB/s) [splits, BLOCK_N, warps] |")
    print("|---|---|---|---|---|")
    for case, slots in itertools.product(args.cases.split(","), args.slots.split(",")):
        bs, ctx = (int(x) for x in case.split("x"))
        dtype = torch.float8_e4m3fn if args.dtype == "fp8" else torch.bfloat16
        nbytes = 2 * bs * ctx * args.heads * args.head_dim * dtype.itemsize
        kvs = [make_kv(bs, ctx, args.heads, args.head_dim, slots == "shuffled", "cuda", seed=i, dtype=dtype)
               for i in range(num_copies(nbytes))]
        best = {}
        for pattern, configs in grid.items():
            for splits, block_n, warps in configs:
                if split_len(ctx, splits, block_n) * (splits - 1) >= ctx:
                    continue  # an empty split: the same as fewer splits
                us = graph_us([read(kv, pattern, splits, block_n, warps)[1] for kv in kvs])
                results.append({"case": case, "slots": slots, "pattern": pattern, "splits": splits,
                                "block_n": block_n, "warps": warps, "us": us, "tb_s": nbytes / us / 1e6})
                if pattern not in best or us < best[pattern][0]:
                    best[pattern] = (us, splits, block_n, warps)
        cells = [f"{u:.1f} ({nbytes / u / 1e6:.2f}) [{s}, {b}, {w}]" for u, s, b, w in (best["per_head"],
                                                                                        best["per_token"])]
        print(f"| {case} | {slots} | {nbytes / 1e6:.1f} | {cells[0]} | {cells[1]} |", flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "peak_tb_s": PEAK_TB_S, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
