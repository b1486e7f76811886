"""Sweep the Triton decode kernel's launch parameters at serving shapes: what the defaults should be.

For each (batch x context) case (bf16, the Llama-3.2-1B attention shape, page 1, shuffled slots) and each combination of
programs per SM and minimum split size (how many KV splits stage 1 gets), BLOCK_N, num_warps and num_stages,
the two-stage kernel is timed per launch over copies of the case's q/K/V (> 256 MB in all) back to back in one
CUDA graph (``common.graph_us``: ``triton.testing.do_bench`` median over the launches). Prints
the best combinations per case, the current default's time, and writes everything as JSON. ``--one-launch``
times the kernel with the merge fused in (semaphores), as the triton backend runs it.

    python benchmarks/sweep_triton_decode.py --out sweep.json
    python benchmarks/sweep_triton_decode.py --one-launch --quick --cases 1x512,64x512
    python benchmarks/sweep_triton_decode.py --tiles-only --cases 1x512,4x512,16x512   # tiles per batch size
    python benchmarks/sweep_triton_decode.py --one-launch --kv-dtype fp8_e4m3 --cases 64x4096,256x4096  # fp8 tiles

``--kv-dtype fp8_e4m3`` (or ``fp8_e5m2``) sweeps over an fp8 cache (the bf16 case quantised with per-head scales);
the fp8 tile defaults are ``decode_attention._fp8_split_kernel_config``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch

from bench_triton_decode import KV_DTYPES, as_kv_dtype, copies_of, make_case
from common import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, PEAK_TB_S, graph_us, require_cuda
from compile_attn.attention.kernels import compute_num_kv_splits, decode_attention_fwd
from compile_attn.attention.kernels.decode_attention import decode_semaphores
from compile_attn.attention.kernels import decode_attention as decode_mod


def run_case(cases: list[dict], max_kv_splits: int, num_sms: int, programs_per_sm: int, split_size: int,
             cfg: dict | None, one_launch: bool = False) -> float:
    """Microseconds per decode launch over ``cases`` (copies of one case) with these launch parameters."""
    case = cases[0]
    q, k_buffer = case["q"], case["k_buffer"]
    bs, num_q_heads, head_dim = q.shape
    out = torch.empty_like(q)
    logits = torch.empty(bs, num_q_heads, max_kv_splits, head_dim, device="cuda")
    lse = torch.empty(bs, num_q_heads, max_kv_splits, device="cuda")
    semaphores = decode_semaphores(bs, num_q_heads, "cuda") if one_launch else None
    default_cfg, default_pps = decode_mod._split_kernel_config, decode_mod.PROGRAMS_PER_SM
    decode_mod._launch_meta.cache_clear()  # it caches the tile config per shape
    try:
        decode_mod.PROGRAMS_PER_SM = programs_per_sm
        if cfg is not None:
            decode_mod._split_kernel_config = lambda *a, **k: dict(cfg)
        splits = compute_num_kv_splits(case["seq_lens"], num_sms, max_kv_splits, split_size=split_size,
                                       num_kv_heads=k_buffer.shape[1])

        def launch(c: dict):  # noqa: ANN202
            scales = {k: c[k] for k in ("k_scale", "v_scale") if k in c}  # an fp8 cache's
            return lambda: decode_attention_fwd(c["q"], c["k_buffer"], c["v_buffer"], out, c["kv_indptr"],
                                                c["kv_indices"], splits, max_kv_splits, logits, lse,
                                                1 / math.sqrt(head_dim), semaphores=semaphores, **scales)

        return graph_us([launch(c) for c in cases], rep=40)
    finally:
        decode_mod._split_kernel_config, decode_mod.PROGRAMS_PER_SM = default_cfg, default_pps
        decode_mod._launch_meta.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1x512,16x512,64x512,256x512,64x4096")
    parser.add_argument("--max-kv-splits", type=int, default=16)
    parser.add_argument("--one-launch", action="store_true",
                        help="merge the splits inside the split kernel (semaphores), as the triton backend does")
    parser.add_argument("--quick", action="store_true", help="a smaller grid (96 combinations per case)")
    parser.add_argument("--tiles-only", action="store_true",
                        help="the default split policy; only BLOCK_N 32/64, 2/4 warps, 2/3 stages (8 per case)")
    parser.add_argument("--kv-dtype", default="bf16", choices=list(KV_DTYPES), help="the cache's dtype")
    parser.add_argument("--grid", default=None,
                        help="the grid itself, e.g. 'pps=8,16;split=64;block_n=64,128;warps=2,4;stages=1,2,3'")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    require_cuda("sweep_triton_decode.py")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(0)
    grid = list(itertools.product((2, 4, 8, 16), (32, 64, 128), (16, 32, 64), (2, 4), (2, 3, 4)))
    if args.quick:
        grid = list(itertools.product((2, 4, 8, 16), (32, 64, 128), (32, 64), (2, 4), (2, 3)))
    if args.tiles_only:
        grid = list(itertools.product((decode_mod.PROGRAMS_PER_SM,), (decode_mod.DEFAULT_SPLIT_SIZE,), (32, 64), (2, 4),
                                      (2, 3)))
    if args.grid:
        axes = dict(part.split("=") for part in args.grid.split(";"))
        grid = list(itertools.product(*(tuple(int(x) for x in axes[k].split(","))
                                        for k in ("pps", "split", "block_n", "warps", "stages"))))
    results = {}
    for name in args.cases.split(","):
        bs, ctx = (int(x) for x in name.split("x"))
        element_size = torch.empty(0, dtype=KV_DTYPES[args.kv_dtype]).element_size()
        kv_bytes = 2 * bs * ctx * NUM_KV_HEADS * HEAD_DIM * element_size
        case = as_kv_dtype(copies_of(make_case(bs, ctx, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, True, gen)),
                           KV_DTYPES[args.kv_dtype])
        default_pps = decode_mod.FP8_PROGRAMS_PER_SM if args.kv_dtype.startswith("fp8") else decode_mod.PROGRAMS_PER_SM
        default = run_case(case, args.max_kv_splits, num_sms, default_pps,
                           decode_mod.DEFAULT_SPLIT_SIZE, None, args.one_launch)
        rows = []
        for pps, split, block_n, warps, stages in grid:
            cfg = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
            try:
                us = run_case(case, args.max_kv_splits, num_sms, pps, split, cfg, args.one_launch)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory for a tile/stage combination
                rows.append(dict(programs_per_sm=pps, split_size=split, **cfg, us=None, error=str(exc)[:80]))
                continue
            rows.append(dict(programs_per_sm=pps, split_size=split, **cfg, us=us))
        ok = sorted((r for r in rows if r["us"] is not None), key=lambda r: r["us"])
        results[name] = dict(default_us=default, kv_bytes=kv_bytes, rows=rows)
        print(f"\n## {name}: default {default:.1f} us ({kv_bytes / default / 1e6 / PEAK_TB_S:.0%} of {PEAK_TB_S} TB/s)")
        print("| programs/SM | min split | BLOCK_N | warps | stages | us | % BW |\n|---|---|---|---|---|---|---|")
        for r in ok[:8 if args.tiles_only else 10]:
            print(f"| {r['programs_per_sm']} | {r['split_size']} | {r['BLOCK_N']} | {r['num_warps']} | "
                  f"{r['num_stages']} | {r['us']:.1f} | "
                  f"{kv_bytes / r['us'] / 1e6 / PEAK_TB_S:.0%} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
