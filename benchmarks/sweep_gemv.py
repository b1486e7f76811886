"""Tiles of the one-row linear kernel (``compile_attn/ops/gemv_kernel.py``): every config of a grid per weight shape.

For each linear layer of the chosen model shapes (one decoder layer's fused q/k/v, o, fused gate/up, down and the
LM head, as one of ``tp`` tensor-parallel ranks holds them) this times the kernel at every ``BLOCK_N`` x
``BLOCK_K`` x warps x stages of the grid, each call reading another copy of the weight inside one CUDA graph
(``bench_gemv.per_call_us``), and prints the best config per shape beside the one ``gemv_config`` picks, cuBLAS
and Inductor's multiply-and-sum, with the bandwidth each reaches. CUDA only.

    python benchmarks/sweep_gemv.py --shapes llama-1b:1,llama-8b:1,llama-8b:2,llama-8b:4 --out sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
from bench_gemv import gemv_as_reduction, per_call_us, rotating_weights
from common import SHAPES, linear_shapes, require_cuda

from compile_attn.ops.gemv_kernel import GemvConfig, gemv_config, launch_gemv

GRID = dict(block_n=(1, 2, 4, 8, 16, 32), block_k=(256, 512, 1024), num_warps=(4, 8), num_stages=(1, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama-1b:1,llama-8b:1,llama-8b:2,llama-8b:4",
                        help="comma-separated SHAPE:TP pairs; shapes: " + ", ".join(sorted(SHAPES)))
    parser.add_argument("--block-n", default=None, help="comma-separated BLOCK_N values (default: the grid's)")
    parser.add_argument("--rep-ms", type=int, default=25, help="measurement time per config (default: 25 ms)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    require_cuda("sweep_gemv.py")
    grid = dict(GRID)
    if args.block_n:
        grid["block_n"] = tuple(int(v) for v in args.block_n.split(","))
    configs = [GemvConfig(*values) for values in itertools.product(*grid.values())]
    sms = torch.cuda.get_device_properties().multi_processor_count
    torch.manual_seed(0)
    rows, lines = [], ["| shape | tp | weight | K x N | MB | cuBLAS us (TB/s) | multiply-sum | picked config | "
                       "picked us (TB/s) | best config | best us (TB/s) |", "|---|" * 11]
    reduction = torch.compile(gemv_as_reduction, dynamic=False)
    for pair in args.shapes.split(","):
        shape_name, tp = pair.split(":")
        for name, k, n in linear_shapes(SHAPES[shape_name], int(tp)):
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            weights = rotating_weights(n, k)
            out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, weights[0]).float().view(-1)
            nbytes = n * k * 2

            def tbs(us: float) -> str:
                return f"{us:.1f} ({nbytes / us / 1e6:.2f})"

            timings = {}
            for config in configs:
                if config.block_k > triton.next_power_of_2(k) or config.block_n * config.block_k > 32768:
                    continue
                launch_gemv(x, weights[0], None, out, config)
                err = (out.float() - ref).abs().max().item()
                if err > 0.05 * ref.abs().max().item() + 1e-2:
                    raise SystemExit(f"{shape_name} tp {tp} {name} {config}: max error {err}")
                timings[config] = per_call_us(lambda x, w, c=config: launch_gemv(x, w, None, out, c), x, weights,
                                              args.rep_ms)
            picked = gemv_config(n, k)
            picked_us = timings.get(picked) or per_call_us(lambda x, w: launch_gemv(x, w, None, out, picked), x,
                                                           weights)
            best = min(timings, key=timings.get)
            cublas_us = per_call_us(F.linear, x, weights)
            torch._dynamo.reset()
            reduction_us = per_call_us(reduction, x, weights)
            rows.append(dict(shape=shape_name, tp=int(tp), name=name, k=k, n=n, mbytes=nbytes / 1e6,
                             cublas_us=cublas_us, reduction_us=reduction_us, picked=picked._asdict(),
                             picked_us=picked_us, best=best._asdict(), best_us=timings[best],
                             all={"/".join(map(str, c)): us for c, us in timings.items()}))
            lines.append(f"| {shape_name} | {tp} | {name} | {k} x {n} | {nbytes / 1e6:.1f} | {tbs(cublas_us)} | "
                         f"{tbs(reduction_us)} | {'/'.join(map(str, picked))} | {tbs(picked_us)} | "
                         f"{'/'.join(map(str, best))} | {tbs(timings[best])} |")
            print(lines[-1], flush=True)
    print(f"configs: BLOCK_N/BLOCK_K/warps/stages; {sms} SMs; {torch.cuda.get_device_name()}")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
