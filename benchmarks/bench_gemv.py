"""One-token linear layers of the Llama-3.2-1B shape: cuBLAS against Inductor's matrix-vector reduction.

At batch 1 every linear layer is a matrix-vector product bound by reading its weight. This times, per weight
shape, ``F.linear`` through cuBLAS (what the compiled pieces call today) and the same ``F.linear`` compiled by
Inductor for a static one-row input with ``coordinate_descent_tuning`` (Inductor then decomposes the ``mm`` into a
fused reduction: what ``GraphConfig.compile_sizes=(1,)`` gives the pieces), with the bandwidth each reaches for
the weight bytes (3.0 TB/s measured on the H100). CUDA only.

    python benchmarks/bench_gemv.py --out gemv.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

# (name, in_features, out_features) of the Llama-3.2-1B shape with fused q/k/v and gate/up
SHAPES = [
    ("qkv", 2048, 3072),
    ("o", 2048, 2048),
    ("gate_up", 2048, 16384),
    ("down", 8192, 2048),
    ("lm_head", 2048, 128256),
]
BANDWIDTH = 3.0e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gemv.py needs a CUDA GPU")
    from triton.testing import do_bench

    torch.manual_seed(0)
    rows = []
    lines = ["| weight | K x N | MB | floor us | cuBLAS us (TB/s) | Inductor reduction us (TB/s) | max abs diff |",
             "|---|---|---|---|---|---|---|"]
    for name, k, n in SHAPES:
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        torch._dynamo.reset()
        compiled = torch.compile(F.linear, dynamic=False, options={"coordinate_descent_tuning": True})
        ref, got = F.linear(x, w), compiled(x, w)
        diff = (ref.float() - got.float()).abs().max().item()
        cublas = do_bench(lambda: F.linear(x, w), warmup=50, rep=300)
        inductor = do_bench(lambda: compiled(x, w), warmup=50, rep=300)
        nbytes = w.numel() * w.element_size()
        floor_us = nbytes / BANDWIDTH * 1e6
        row = dict(name=name, k=k, n=n, mbytes=nbytes / 1e6, floor_us=floor_us, cublas_us=cublas * 1e3,
                   inductor_us=inductor * 1e3, max_abs_diff=diff)
        rows.append(row)
        lines.append(f"| {name} | {k} x {n} | {nbytes / 1e6:.1f} | {floor_us:.1f} | {cublas * 1e3:.1f} "
                     f"({nbytes / cublas / 1e9:.2f}) | {inductor * 1e3:.1f} ({nbytes / inductor / 1e9:.2f}) | "
                     f"{diff:.3g} |")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
