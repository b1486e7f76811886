"""One-token linear layers of the Llama-3.2-1B shape: cuBLAS against Inductor's matrix-vector reduction.

At batch 1 every linear layer is a matrix-vector product bound by reading its weight. This times, per weight
shape, ``F.linear`` through cuBLAS (what the compiled pieces call today) and the same ``F.linear`` compiled by
Inductor for a static one-row input with ``coordinate_descent_tuning`` (Inductor then decomposes the ``mm`` into a
fused reduction: what ``GraphConfig.compile_sizes=(1,)`` gives the pieces), and the same product written as a
multiply-and-sum compiled with Inductor's default config (no runtime tuning), with the bandwidth each reaches
for the weight bytes (``common.BANDWIDTH``). Each call reads a different copy of the weight inside one
CUDA graph, so neither launch gaps nor L2 hits flatter the small shapes. CUDA only.

``--rows N`` times an ``N``-row input instead (a decode step at batch ``N``); the multiply-and-sum variant is for
one row only, and ``--max-autotune`` adds Inductor's ``max-autotune`` (Triton ``mm`` templates benchmarked against
cuBLAS for the static shape). ``--decompose-k`` adds max-autotune with Inductor's split-K choice ("decompose K":
a batched ``mm`` over K chunks, then their sum) offered for every shape (``triton.decompose_k_threshold`` 0; by
default Inductor offers it only for K >= 32 x max(M, N)). Its split counts are divisors of K up to
min(K / M, K / N), so at 64 rows only ``down`` (K 8192, 4 splits at most) gets a split-K candidate; q/k/v and o,
whose 16-24 output tiles leave most of the 132 SMs idle in cuBLAS, get none. ``--split-k`` times the same
split by hand for every shape: cuBLAS batched ``mm`` over 2, 4 and 8 K chunks into fp32 (``bmm(out_dtype=)``),
then their sum in eager torch (best count shown). ``--cublaslt`` times ``F.linear`` with cuBLASLt as torch's
preferred BLAS library (``TORCH_BLAS_PREFER_CUBLASLT=1``).

    python benchmarks/bench_gemv.py --out gemv.json
    python benchmarks/bench_gemv.py --rows 64 --max-autotune --decompose-k --split-k --cublaslt
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from common import BANDWIDTH, linear_shapes

SHAPES = linear_shapes()  # (name, in_features, out_features), q/k/v and gate/up fused
# max-autotune (as mode="max-autotune-no-cudagraphs") with the decompose-K choice offered whatever the shape
DECOMPOSE_K_OPTIONS = {"max_autotune": True, "triton.cudagraphs": False, "triton.decompose_k_threshold": 0}


def rotating_weights(n: int, k: int, min_bytes: float = 256e6) -> list[torch.Tensor]:
    """Enough copies of an ``n x k`` weight that one pass over them does not fit in L2."""
    copies = max(1, int(min_bytes // (n * k * 2)) + 1)
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]


def gemv_as_reduction(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` for one row written as multiply-and-sum in fp32 (Inductor's own ``mm`` decomposition)."""
    return (x.float().unsqueeze(-2) * w.float()).sum(-1).to(x.dtype)


def split_k_linear(splits: int):
    """``F.linear(x, w)`` as ``splits`` matrix products over K chunks (one cuBLAS batched ``mm``, fp32 out) summed."""

    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        rows, k = x.shape
        n = w.shape[0]
        xs = x.view(rows, splits, k // splits).transpose(0, 1)  # [S, rows, K/S]
        ws = w.view(n, splits, k // splits).permute(1, 2, 0)  # [S, K/S, N], column-major per chunk
        return torch.bmm(xs, ws, out_dtype=torch.float32).sum(0).to(x.dtype)

    return linear


def cublaslt_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear`` with cuBLASLt as the preferred BLAS library for the call."""
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, w)
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def per_call_us(fn, x: torch.Tensor, weights: list[torch.Tensor], rep_ms: int = 200) -> float:
    """Microseconds per call of ``fn(x, w)``, all ``weights`` in turn inside one CUDA graph (no launch gaps,
    no L2 reuse between calls), measured for ``rep_ms``."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(lambda: [fn(x, w) for w in weights], rep=rep_ms) * 1e3 / len(weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1, help="rows of the input (the decode batch size)")
    parser.add_argument("--max-autotune", action="store_true", help="also time Inductor max-autotune")
    parser.add_argument("--decompose-k", action="store_true",
                        help="also time max-autotune with Inductor's split-K (decompose K) choice for every shape")
    parser.add_argument("--split-k", action="store_true",
                        help="also time cuBLAS split-K by hand (batched mm over 2/4/8 K chunks, then their sum)")
    parser.add_argument("--cublaslt", action="store_true", help="also time F.linear with cuBLASLt preferred")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.rows < 1:
        raise SystemExit(f"--rows must be >= 1, got {args.rows}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv.py needs a CUDA GPU")

    if args.decompose_k and "triton.decompose_k_threshold" not in torch._inductor.config.get_config_copy():
        raise SystemExit(f"--decompose-k: torch {torch.__version__}'s Inductor has no decompose-K choice")
    torch.manual_seed(0)
    # (key, column title, a factory of the linear it times (called per shape: a fresh compile each), timed in this run)
    table = [
        ("cublas", "cuBLAS", lambda: F.linear, True),
        ("inductor_coordesc", "Inductor mm, coordinate descent",
         lambda: torch.compile(F.linear, dynamic=False, options={"coordinate_descent_tuning": True}), True),
        ("inductor_reduction", "Inductor multiply-sum, default config",
         lambda: torch.compile(gemv_as_reduction, dynamic=False), args.rows == 1),
        ("inductor_max_autotune", "Inductor max-autotune",
         lambda: torch.compile(F.linear, dynamic=False, mode="max-autotune-no-cudagraphs"), args.max_autotune),
        ("inductor_decompose_k", "Inductor max-autotune with split-K",
         lambda: torch.compile(F.linear, dynamic=False, options=DECOMPOSE_K_OPTIONS), args.decompose_k),
        ("cublaslt", "cuBLASLt", lambda: cublaslt_linear, args.cublaslt),
        *((f"split_k_{s}", f"cuBLAS bmm split-K {s} + sum", lambda s=s: split_k_linear(s), args.split_k)
          for s in (2, 4, 8)),
    ]
    variants = {key: make for key, _, make, on in table if on}
    titles = {key: title for key, title, _, _ in table}
    rows = []
    lines = ["| weight | K x N | MB | floor us | " + " | ".join(f"{titles[v]} us (TB/s)" for v in variants)
             + " | max abs diff against cuBLAS |",
             "|---|---|---|---|" + "---|" * (len(variants) + 1)]
    print(f"{args.rows}-row input; each cell: microseconds per call (TB/s of the weight bytes)")
    for name, k, n in SHAPES:
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        weights = rotating_weights(n, k)
        nbytes = n * k * 2
        ref = F.linear(x, weights[0]).float()
        row = dict(name=name, k=k, n=n, rows=args.rows, mbytes=nbytes / 1e6, floor_us=nbytes / BANDWIDTH * 1e6)
        cells, diffs = [], []
        for variant, make in variants.items():
            torch._dynamo.reset()
            fn = make()
            diff = (fn(x, weights[0]).float() - ref).abs().max().item()
            us = per_call_us(fn, x, weights)
            row[f"{variant}_us"], row[f"{variant}_max_abs_diff"] = us, diff
            cells.append(f"{us:.1f} ({nbytes / us / 1e6:.2f})")
            if variant != "cublas":
                diffs.append(f"{diff:.3g}")
        rows.append(row)
        lines.append(f"| {name} | {k} x {n} | {nbytes / 1e6:.1f} | {row['floor_us']:.1f} | " + " | ".join(cells)
                     + f" | {' / '.join(diffs)} |")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
