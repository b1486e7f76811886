"""Shared-prefix (cascade) decode attention against plain decode, on a batch whose requests share a long prefix.

B requests (default 256) share P prefix tokens (2,048) and hold O own tokens each (128), on a paged bf16 cache with
shuffled pages, the Llama-3.2-1B attention shape (``common``). Three timings, each per launch inside a CUDA graph
over copies of the K/V (``graph_us``: no launch finds the previous one's KV in L2), median of do_bench:

* cascade: ``cascade_decode_fwd`` (level 1 reads the shared prefix once per block of (request, head) rows, level 2
  reads each request's own tokens and merges), with the default level-1 tiles and prefix splits, then a small sweep
  of level-1 tiles and split counts, each with the levels one after the other ("fused": level 2 merges) and with
  level 1 on a side stream next to level 2 ("streams": a third launch merges);
* plain: ``decode_attention_fwd`` over prefix + own tokens of every request (the prefix read B times);
* own only: ``decode_attention_fwd`` over the O own tokens alone (the floor the cascade path aims at), and the
  cascade's level 2 alone over them (no group: how it compares with the decode kernel; fused minus this is about
  level 1's share);
* FlashInfer's two-level cascade (``attention/flashinfer/cascade.py``), when flashinfer is installed (eagerly
  timed if its run cannot be captured).

Prints the times and the ratio cascade / own-only, checks the cascade output against plain decode's, and writes JSON
to --out.

    python benchmarks/bench_cascade.py --out cascade.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton.testing

from common import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, PEAK_BF16_FLOPS, graph_us, num_copies, require_cuda
from compile_attn.attention.kernels import compute_num_kv_splits, decode_attention_fwd, decode_semaphores
from compile_attn.attention.kernels.cascade_attention import (
    MAX_PREFIX_SPLITS,
    cascade_decode_fwd,
    cascade_scratch,
    default_prefix_config,
)
from compile_attn.attention.kernels.cascade_index import build_cascade_index

MAX_KV_SPLITS = 16
DEVICE = "cuda"
# Level-1 variants tried after the default, each fused and on two streams: (tile overrides, number of prefix splits
# or None for the default rule).
SWEEP = [({}, None),
    ({}, 1), ({}, 2), ({}, 4),
    ({"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}, None),
    ({"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}, None),
    ({"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}, None),
    ({"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}, None),
    ({"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}, None),
]


def make_table(bs: int, prefix: int, own: int, page_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """``req_to_token`` [bs, prefix + own] (int32, on the GPU): every row starts with the same prefix slots, then
    slots of its own; pages shuffled, page 0 (scratch) unused. Returns the table and the number of slots."""
    prefix_pages = -(-prefix // page_size)
    own_pages = -(-own // page_size)
    num_pages = 1 + prefix_pages + bs * own_pages
    order = torch.randperm(num_pages - 1, generator=gen) + 1
    offsets = torch.arange(page_size)

    def slots(pages: torch.Tensor, n: int) -> torch.Tensor:
        return (pages[:, None] * page_size + offsets).flatten()[:n]

    shared = slots(order[:prefix_pages], prefix)
    rows = [torch.cat([shared, slots(order[prefix_pages + b * own_pages: prefix_pages + (b + 1) * own_pages], own)])
            for b in range(bs)]
    return torch.stack(rows).to(torch.int32).to(DEVICE), num_pages * page_size


def time_flashinfer(copies: list, out: torch.Tensor, table: torch.Tensor, seq_lens_cpu: list, groups: list,
                    page_size: int, scale: float, rep: int) -> dict:
    """FlashInfer's cascade on the same batch: {"us": ..., "graph": bool, "out": first copy's output} or
    {"error": ...}."""
    try:
        from compile_attn.attention.flashinfer.cascade import FlashInferCascadeDecode

        cascade = FlashInferCascadeDecode(torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE))
        bs, hq, d = copies[0]["q"].shape
        cascade.plan(table, list(range(bs)), seq_lens_cpu, groups, page_size=page_size, num_qo_heads=hq,
                     num_kv_heads=copies[0]["k"].shape[1], head_dim=d, sm_scale=scale)
        launches = [lambda c=c: cascade.run(c["q"], c["k"], c["v"], out) for c in copies]
        try:
            row = {"us": graph_us(launches, rep=rep), "graph": True}
        except Exception:  # noqa: BLE001  (its run cannot be captured in this version: time it eagerly)
            torch.cuda.synchronize()
            row = {"us": triton.testing.do_bench(launches[0], warmup=25, rep=rep, return_mode="median") * 1e3,
                   "graph": False}
        launches[0]()
        row["out"] = out.clone()
        return row
    except Exception as exc:  # noqa: BLE001  (not installed, or this version refuses the shape)
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens")
    parser.add_argument("--own", type=int, default=128, help="own tokens per request (after the prefix)")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--no-sweep", action="store_true", help="time only the default level-1 configuration")
    parser.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer's cascade")
    parser.add_argument("--rep", type=int, default=100, help="do_bench's time budget per timing, ms")
    args = parser.parse_args()
    require_cuda("bench_cascade.py")

    bs, prefix, own = args.batch, args.prefix, args.own
    hq, hkv, d = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    scale = 1 / math.sqrt(d)
    gen = torch.Generator().manual_seed(0)
    table, num_slots = make_table(bs, prefix, own, args.page_size, gen)
    rows = torch.arange(bs, dtype=torch.int64, device=DEVICE)
    seq_lens_cpu = [prefix + own] * bs
    seq_lens = torch.tensor(seq_lens_cpu, dtype=torch.int32, device=DEVICE)
    groups = [(list(range(bs)), prefix)]
    index = build_cascade_index(table, rows, seq_lens, groups, req_pool_indices_cpu=list(range(bs)),
                                seq_lens_cpu=seq_lens_cpu)
    full_indptr = torch.arange(bs + 1, dtype=torch.int32, device=DEVICE) * (prefix + own)
    full_indices = table.flatten().contiguous()
    own_indptr = torch.arange(bs + 1, dtype=torch.int32, device=DEVICE) * own
    own_indices = table[:, prefix:].flatten().contiguous()

    kv_bytes = 2 * num_slots * hkv * d * 2
    copies = [
        {"q": torch.randn(bs, hq, d, dtype=torch.bfloat16, device=DEVICE),
         "k": torch.randn(num_slots, hkv, d, dtype=torch.bfloat16, device=DEVICE),
         "v": torch.randn(num_slots, hkv, d, dtype=torch.bfloat16, device=DEVICE)}
        for _ in range(num_copies(kv_bytes))
    ]
    out = torch.empty(bs, hq, d, dtype=torch.bfloat16, device=DEVICE)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    logits = torch.empty(bs, hq, MAX_KV_SPLITS, d, dtype=torch.float32, device=DEVICE)
    lse = torch.empty(bs, hq, MAX_KV_SPLITS, dtype=torch.float32, device=DEVICE)
    semaphores = decode_semaphores(bs, hq, DEVICE)  # one-launch decode, as the triton backend runs it
    part_out, part_lse = cascade_scratch(bs, hq, d, MAX_PREFIX_SPLITS, DEVICE)

    def decode_launches(indptr: torch.Tensor, indices: torch.Tensor, length: int) -> list:
        lens = torch.full((bs,), length, dtype=torch.int32, device=DEVICE)
        splits = compute_num_kv_splits(lens, num_sms, MAX_KV_SPLITS, num_kv_heads=hkv)
        return [lambda c=c: decode_attention_fwd(c["q"], c["k"], c["v"], out, indptr, indices, splits, MAX_KV_SPLITS,
                                                 logits, lse, scale, semaphores=semaphores) for c in copies]

    side = torch.cuda.Stream() if DEVICE == "cuda" else None

    def cascade_launches(config: dict, splits: int | None, mode: str) -> list:
        streams = mode == "streams"
        return [lambda c=c: cascade_decode_fwd(c["q"], c["k"], c["v"], out, index, scale, num_prefix_splits=splits,
                                               part_out=part_out, part_lse=part_lse, prefix_config=config,
                                               split_levels=streams, side_stream=side if streams else None)
                for c in copies]

    def first_output(launches: list) -> torch.Tensor:
        launches[0]()
        return out.clone()

    plain_launches = decode_launches(full_indptr, full_indices, prefix + own)
    plain_us = graph_us(plain_launches, rep=args.rep)
    plain_out = first_output(plain_launches)
    own_us = graph_us(decode_launches(own_indptr, own_indices, own), rep=args.rep)

    own_table = table[:, prefix:].contiguous()
    own_lens = torch.full((bs,), own, dtype=torch.int32, device=DEVICE)
    own_index = build_cascade_index(own_table, rows, own_lens, [], req_pool_indices_cpu=list(range(bs)),
                                    seq_lens_cpu=[own] * bs)
    level2_us = graph_us([lambda c=c: cascade_decode_fwd(c["q"], c["k"], c["v"], out, own_index, scale,
                                                          part_out=part_out, part_lse=part_lse) for c in copies],
                         rep=args.rep)

    default = default_prefix_config(d, d)
    variants = [(overrides, splits, mode) for overrides, splits in ([({}, None)] if args.no_sweep else SWEEP)
                for mode in ("fused", "streams")]
    sweep = []
    for overrides, splits, mode in variants:
        config = {**default, **overrides}
        row = {"config": config, "num_prefix_splits": splits if splits is not None else "auto", "mode": mode}
        try:
            launches = cascade_launches(config, splits, mode)
            row["us"] = graph_us(launches, rep=args.rep)
            cascade_out = first_output(launches)
            row["max_abs_diff_vs_plain"] = (cascade_out.float() - plain_out.float()).abs().max().item()
        except Exception as exc:  # noqa: BLE001  (a tile config this GPU cannot run: record it, go on)
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        sweep.append(row)
    timed = [r for r in sweep if "us" in r]
    if not timed:
        raise SystemExit(f"no cascade configuration ran: {sweep[0].get('error')}")
    cascade = sweep[0] if "us" in sweep[0] else timed[0]
    streams = next((r for r in sweep[:2] if r["mode"] == "streams" and "us" in r), cascade)
    best = min(timed, key=lambda r: r["us"])

    fi = {"error": "skipped (--no-flashinfer)"} if args.no_flashinfer else time_flashinfer(
        copies, out, table, seq_lens_cpu, groups, args.page_size, scale, args.rep)
    if "out" in fi:
        fi["max_abs_diff_vs_plain"] = (fi.pop("out").float() - plain_out.float()).abs().max().item()

    result = {
        "device": torch.cuda.get_device_name(),
        "batch": bs, "prefix": prefix, "own": own, "page_size": args.page_size,
        "num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d, "dtype": "bfloat16",
        "plain_us": plain_us, "own_only_us": own_us, "level2_alone_us": level2_us,
        "cascade_us": cascade["us"], "cascade_config": cascade["config"],
        "cascade_streams_us": streams["us"],
        "cascade_best_us": best["us"], "cascade_best_config": best["config"],
        "cascade_best_num_prefix_splits": best["num_prefix_splits"], "cascade_best_mode": best["mode"],
        "ratio_cascade_over_own_only": cascade["us"] / own_us,
        "ratio_cascade_streams_over_own_only": streams["us"] / own_us,
        "ratio_best_cascade_over_own_only": best["us"] / own_us,
        "ratio_plain_over_cascade": plain_us / cascade["us"],
        "level1_flops": 4 * bs * hq * prefix * d,
        "level1_floor_us": 4 * bs * hq * prefix * d / PEAK_BF16_FLOPS * 1e6,  # its matmuls at peak bf16
        "flashinfer_cascade": fi,
        "sweep": sweep,
    }
    print(f"\nDecode attention, {bs} requests x ({prefix} shared + {own} own) tokens, bf16, Hq={hq} Hkv={hkv} D={d}, "
          f"page {args.page_size}, {result['device']}; us per launch inside a CUDA graph (median)")
    print("| path | us | / own only |")
    print("|---|---|---|")
    print(f"| cascade (default config, levels fused) | {cascade['us']:.1f} | {cascade['us'] / own_us:.2f}x |")
    print(f"| cascade (default config, two streams) | {streams['us']:.1f} | {streams['us'] / own_us:.2f}x |")
    print(f"| cascade (best of sweep: {best['mode']}) | {best['us']:.1f} | {best['us'] / own_us:.2f}x |")
    print(f"| plain decode over prefix + own | {plain_us:.1f} | {plain_us / own_us:.2f}x |")
    print(f"| own tokens only | {own_us:.1f} | 1.00x |")
    print(f"| own tokens only, cascade level 2 | {level2_us:.1f} | {level2_us / own_us:.2f}x |")
    if "us" in fi:
        print(f"| FlashInfer cascade{'' if fi['graph'] else ' (eager)'} | {fi['us']:.1f} | {fi['us'] / own_us:.2f}x |")
    else:
        print(f"\nFlashInfer cascade not timed: {fi['error']}")
    print(f"\nLevel 1's matmuls ({result['level1_flops'] / 1e9:.1f} GFLOP) take {result['level1_floor_us']:.1f} us at "
          f"{PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s.")
    print("\nLevel-1 sweep (diff: max |cascade - plain| over the output):")
    for r in sweep:
        shown = f"{r['us']:.1f} us, diff {r['max_abs_diff_vs_plain']:.1e}" if "us" in r else r["error"]
        print(f"  {r['mode']} {r['config']} splits={r['num_prefix_splits']}: {shown}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
