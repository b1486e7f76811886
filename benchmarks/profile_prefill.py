"""Where an 8 x 1024-token prefill step of the engine goes: wall time, GPU busy time, kernels by total time.

Builds the Llama-3.2-1B-shaped model (random bf16 weights) in ``LLM`` with the given backend, runs one warm-up
``generate`` of ``requests`` prompts with ``max_new_tokens=1`` (one prefill step), then profiles one more and
prints: wall ms, GPU busy ms (sum of kernel times), the kernels by total time (with achieved TFLOP/s for GEMMs is
left to the reader: shapes are in the names), and the host side by self CPU time.

    python benchmarks/profile_prefill.py --backend triton --out $OUT/prefill.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from profile_decode_step import aggregate


def sync_sites(fn) -> dict[str, int]:
    """Call sites (compile_attn frames of the stack) of every CUDA call in ``fn()`` that waits for the GPU."""
    import traceback
    import warnings

    sites: dict[str, int] = defaultdict(int)

    def record(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        frames = [f for f in traceback.extract_stack()[:-1] if "compile_attn" in f.filename]
        sites["".join(traceback.format_list(frames[-5:]))] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():  # restores showwarning and the filters on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(sites)


def idle_gaps(kernels, top: int = 12) -> tuple[float, list[tuple[float, str, str]]]:
    """Total GPU idle time (ms) between the first and last kernel, and the ``top`` longest gaps as
    (ms, kernel before, kernel after): where the GPU waited for the host."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in kernels)
    gaps, end, prev = [], spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append(((start - end) / 1e3, prev, name))
        if stop > end:
            end, prev = stop, name
    return sum(g[0] for g in gaps), sorted(gaps, reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--out", default=None)
    parser.add_argument("--cprofile", type=int, default=40,
                        help="print the host's cProfile of 5 steps, this many functions by cumulative time (0: off)")
    args = parser.parse_args()

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from compile_attn.bench import decode_step as bench
    from compile_attn.bench.engine_start import prefill_flops
    from compile_attn.engine import LLM, SamplingParams

    tokens = args.requests * args.prompt_len
    shape = dict(bench.LLAMA_1B)
    model = bench._hf_model(bench.BenchConfig(shape=shape, device="cuda"), "sdpa", torch.bfloat16)
    llm = LLM(model, attn_backend=args.backend, max_batch_size=args.requests, max_num_tokens=tokens,
              kv_cache_tokens=tokens + 1024, max_context=args.prompt_len + 64, device="cuda", dtype=torch.bfloat16,
              compile_options={"cache_dir": None, "extend_token_sizes": (tokens,), "decode_batch_sizes": (1,)})
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, shape["vocab_size"], (args.requests, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    walls = []
    for _ in range(5):
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    wall_ms = sorted(walls)[2] * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and e.device_time > 0]
    rows = aggregate([(e.name, e.device_time) for e in kernels])
    busy_ms = sum(e.device_time for e in kernels) / 1e3
    span_ms = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)) / 1e3
    flops = prefill_flops(shape, args.requests, args.prompt_len)
    print(f"## prefill {args.requests} x {args.prompt_len}, backend {llm.backend.name}\n")
    print(f"wall {wall_ms:.1f} ms (median of 5) = {flops / wall_ms / 1e9:.0f} TFLOP/s; GPU busy {busy_ms:.1f} ms "
          f"(= {flops / busy_ms / 1e9:.0f} TFLOP/s); first to last kernel {span_ms:.1f} ms; {len(kernels)} kernels\n")
    print("| kernel | count | total ms | % of busy |\n|---|---|---|---|")
    for row in rows[:25]:
        print(f"| {row['kernel'][:100]} | {row['count']} | {row['total_us'] / 1e3:.2f} | "
              f"{100 * row['total_us'] / 1e3 / busy_ms:.0f}% |")
    idle_ms, gaps = idle_gaps(kernels)
    print(f"\nGPU idle between first and last kernel: {idle_ms:.2f} ms; longest gaps:\n")
    print("| gap ms | after | before |\n|---|---|---|")
    for ms, before, after in gaps:
        print(f"| {ms:.3f} | {before[:70]} | {after[:70]} |")
    print("\n```\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20,
                                                   max_name_column_width=60) + "\n```")
    if args.cprofile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(5):
            llm.generate(prompts, params)
        torch.cuda.synchronize()
        profiler.disable()
        print("\n## host cProfile of 5 prefill steps (inflated by the profiler: for ranking)\n\n```")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.cprofile)
        print("```")
    print("\n## synchronizing CUDA calls in one prefill step (torch.cuda.set_sync_debug_mode)\n")
    for site, count in sync_sites(lambda: llm.generate(prompts, params)).items():
        print(f"- {count} x\n```\n{site}```")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(wall_ms=wall_ms, busy_ms=busy_ms, span_ms=span_ms, idle_ms=idle_ms, flops=flops,
                           kernels=rows), f, indent=1)


if __name__ == "__main__":
    main()
