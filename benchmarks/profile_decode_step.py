"""Kernel-by-kernel profile of one compile_attn decode step (Llama-3.2-1B shape): what the GPU runs and for how long.

For each batch size, one GraphRunner step (full graph by default) is profiled with torch.profiler; the kernels
of one step are listed in launch order for the first decoder layer, and aggregated by kernel name for the whole
step (count, total and mean microseconds), next to the step's weight bytes over the bandwidth limit. This is the
"where does the time go" view behind benchmarks/RESULTS.md.

    python benchmarks/profile_decode_step.py --backend triton --mode full --batch-sizes 1,64 --out prof.json
"""

from __future__ import annotations

import argparse
import json
import logging
from collections import defaultdict

import torch

from compile_attn.bench import decode_step as bench
from compile_attn.config import parse_compile_sizes


def step_kernels(fn) -> tuple[list[tuple[str, float]], float]:
    """(kernel name, microseconds) of one call of ``fn`` after a warm-up call, in launch order, and the GPU busy
    microseconds (``bench.busy_us``: overlapping kernels count once; with dependent launches a kernel's own time
    includes its wait for the one before it)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and e.device_time > 0]
    ordered = sorted(kernels, key=lambda e: e.time_range.start)
    busy = bench.busy_us([(e.time_range.start, e.time_range.end) for e in ordered])
    return [(e.name, e.device_time) for e in ordered], busy


def first_layer(kernels: list[tuple[str, float]], marker: str) -> list[tuple[str, float]]:
    """Kernels from the start of the step up to the second attention kernel: embedding, layer 0 whole,
    and layer 1 up to its attention (so one full layer's sequence is visible)."""
    hits = [i for i, (name, _) in enumerate(kernels) if marker in name.lower()]
    return kernels[:hits[1] + 1] if len(hits) > 1 else kernels


def host_table(fn, steps: int = 10) -> str:
    """torch.profiler's CPU-side table of ``steps`` calls of ``fn``, by self CPU time (Python functions included)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)


def aggregate(kernels: list[tuple[str, float]]) -> list[dict]:
    by_name: dict[str, list[float]] = defaultdict(list)
    for name, us in kernels:
        by_name[name].append(us)
    rows = [dict(kernel=name, count=len(t), total_us=sum(t), mean_us=sum(t) / len(t)) for name, t in by_name.items()]
    return sorted(rows, key=lambda r: -r["total_us"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--mode", default="full")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--no-fuse-linears", action="store_true")
    parser.add_argument("--compile-sizes", default="auto",
                        help="GraphConfig.compile_sizes: 'auto' (1 on a GPU), 'none', or comma-separated counts")
    parser.add_argument("--inductor-config", default="{}",
                        help='Inductor config patches for the compiled pieces, JSON, e.g. \'{"combo_kernels": false}\'')
    parser.add_argument("--attention-marker", default="decode_split", help="substring of the attention kernel's name")
    parser.add_argument("--host", action="store_true",
                        help="also print the host (CPU) side of a step: torch.profiler table by self CPU time")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    from compile_attn.hf import HFModelAdapter

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    cfg = bench.BenchConfig(batch_sizes=sizes, context=args.context, backends=[args.backend], modes=[args.mode],
                            hf_baselines=[], fuse_linears=not args.no_fuse_linears,
                            inductor_config=json.loads(args.inductor_config),
                            compile_sizes=parse_compile_sizes(args.compile_sizes))
    model = bench._hf_model(cfg, "sdpa", torch.bfloat16)
    floors = {bs: bench.floor_ms(model, cfg, bs, torch.bfloat16) for bs in sizes}
    adapter = HFModelAdapter(model)
    setup = bench.DecodeSetup(adapter, cfg, args.backend, torch.bfloat16)
    runner, _, _ = bench.make_runner(adapter, setup, cfg, args.mode)
    report = {}
    with torch.inference_mode():
        for bs in sizes:
            fb = setup.batch(bs)
            kernels, busy = step_kernels(lambda: runner.run(fb))
            layer = first_layer(kernels, args.attention_marker)
            report[bs] = dict(kernels_per_step=len(kernels), busy_us=busy, floor_us=floors[bs] * 1e3,
                              first_layer=[dict(kernel=n, us=us) for n, us in layer], by_name=aggregate(kernels))
            print(f"\n## bs {bs}: {len(kernels)} kernels, GPU busy {busy:.0f} us, floor {floors[bs] * 1e3:.0f} us")
            print("| # | kernel (start of step through layer 0) | us |\n|---|---|---|")
            for i, (name, us) in enumerate(layer):
                print(f"| {i} | {name[:90]} | {us:.1f} |")
            if args.host:
                print(f"\n### host side of 10 steps, bs {bs}\n```\n{host_table(lambda: runner.run(fb))}\n```")
            print("\n| kernel | per step | total us | mean us |\n|---|---|---|---|")
            for row in report[bs]["by_name"][:25]:
                print(f"| {row['kernel'][:90]} | {row['count']} | {row['total_us']:.0f} | {row['mean_us']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
