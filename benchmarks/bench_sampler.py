"""Benchmark ``sample()``: rows x vocab logits (random normal, bf16 and float32) for greedy, temperature only,
top-k 50, top-p 0.9, top-k 50 + top-p 0.9 and min_p 0.1, seeded and unseeded, through each implementation.

Implementations: ``old-sort`` (the sampler before this one, kept here as the baseline: full-vocabulary
softmax, sort and int64 hash noise for every row), ``portable`` (compiled, the engine's default on CUDA),
``portable-eager``, ``flashinfer`` (unseeded filtered rows; where installed) and ``auto`` (what the engine
runs), plus ``argmax`` for greedy rows. The ``SamplingPlan`` is built once per case, as the engine builds
it on the host. CUDA times are triton's ``do_bench`` medians (L2 flushed; a call slower on the host than on
the device shows its host time); CPU times are wall-clock medians. ``warmup`` runs first and is timed.

    python benchmarks/bench_sampler.py --out sampler.json                       # GPU: rows 1/64/256 x 128,256
    python benchmarks/bench_sampler.py --rows 4 --vocab 1000 --out smoke.json   # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from compile_attn.engine.execution.sampling.sampler import SamplingPlan, sample, warmup
from compile_attn.engine.execution.sampling import flashinfer_sampling
from compile_attn.engine.execution.sampling.noise import hashed_uniform

CASES: dict[str, tuple[float, int, float, float]] = {  # temperature, top_k, top_p, min_p
    "greedy": (0.0, 0, 1.0, 0.0),
    "temperature": (0.7, 0, 1.0, 0.0),
    "top-k 50": (0.7, 50, 1.0, 0.0),
    "top-p 0.9": (0.7, 0, 0.9, 0.0),
    "top-k 50 + top-p 0.9": (0.7, 50, 0.9, 0.0),
    "min_p 0.1": (0.7, 0, 1.0, 0.1),
}
DTYPES = {"bf16": torch.bfloat16, "float32": torch.float32}


def old_sort_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The previous sampler: softmax, a full sort and noise over the whole vocabulary for every row."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    probs = (logits / temperature.clamp(min=1e-5)[:, None]).softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    keep_sorted = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    keep_sorted &= (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p[:, None]
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    noise = -torch.log(hashed_uniform(seeds, positions, logits.shape[-1]))
    sampled = (probs.masked_fill(~keep, 0.0) / noise).argmax(dim=-1)
    return torch.where(temperature <= 0, greedy, sampled)


def time_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def implementations(case: str, seeded: bool, device: torch.device) -> list[str]:
    names = ["old-sort", "portable", "portable-eager", "auto"]
    filtered = CASES[case][1] > 0 or CASES[case][2] < 1.0
    if filtered and not seeded and flashinfer_sampling.available(device):
        names.append("flashinfer")
    if case == "greedy":
        names.append("argmax")
    return names


def bench(rows: int, vocab: int, dtype: torch.dtype, device: torch.device, reps: int) -> list[dict]:
    results = []
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():  # the logits of an inference-mode forward, as in the engine
        logits = torch.randn(rows, vocab, generator=gen).to(device=device, dtype=dtype)
    for case, (t, k, p, m) in CASES.items():
        temperature = torch.full((rows,), t, device=device)
        top_k = torch.full((rows,), k, device=device, dtype=torch.int64)
        top_p = torch.full((rows,), p, device=device)
        min_p = torch.full((rows,), m, device=device)
        seeds = torch.arange(rows, device=device)
        positions = torch.full((rows,), 100, device=device, dtype=torch.int64)
        for seeded in (True, False):
            plan = SamplingPlan.for_rows([t] * rows, [k] * rows, [p] * rows, [m] * rows, seeded)
            uploads = dict(top_k=top_k if plan.max_top_k else None, top_p=top_p if plan.top_p_rows else None,
                           min_p=min_p if plan.min_p_rows else None)  # what the engine uploads for the plan
            calls: dict[str, Callable[[], object]] = {
                "old-sort": lambda: old_sort_sample(logits, temperature, top_k, top_p, seeds, positions),
                "portable": lambda: sample(logits, temperature, seeds=seeds, positions=positions, plan=plan,
                                           backend="portable", compiled=True, **uploads),
                "portable-eager": lambda: sample(logits, temperature, seeds=seeds, positions=positions, plan=plan,
                                                 backend="portable", compiled=False, **uploads),
                "auto": lambda: sample(logits, temperature, seeds=seeds, positions=positions, plan=plan, **uploads),
                "flashinfer": lambda: sample(logits, temperature, seeds=seeds, positions=positions, plan=plan,
                                             backend="flashinfer", **uploads),
                "argmax": lambda: logits.argmax(-1),
            }
            for impl in implementations(case, seeded, device):
                ms = time_ms(calls[impl], device, reps)
                results.append(dict(impl=impl, case=case, seeded=seeded, rows=rows, vocab=vocab,
                                    dtype=str(dtype).removeprefix("torch."), ms=ms))
    return results


def markdown(results: list[dict]) -> str:
    impls = list(dict.fromkeys(r["impl"] for r in results))
    lines = ["| case | seeded | dtype | rows | " + " | ".join(f"{i} (ms)" for i in impls) + " |",
             "|---|---|---|---|" + "---|" * len(impls)]
    keys = list(dict.fromkeys((r["case"], r["seeded"], r["dtype"], r["rows"]) for r in results))
    by_key = {(r["case"], r["seeded"], r["dtype"], r["rows"], r["impl"]): r["ms"] for r in results}
    for key in keys:
        cells = [f"{by_key[(*key, i)]:.3f}" if (*key, i) in by_key else "-" for i in impls]
        lines.append(f"| {key[0]} | {'yes' if key[1] else 'no'} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "float32"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per measurement on the CPU")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    results, warmups = [], []
    for name in args.dtypes:
        t0 = time.perf_counter()
        warmup(device, args.vocab, max(args.rows), dtype=DTYPES[name], compiled=True)
        warmups.append(dict(dtype=name, seconds=time.perf_counter() - t0))
        for rows in args.rows:
            results += bench(rows, args.vocab, DTYPES[name], device, args.reps)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"sample() on {device_name}, vocab {args.vocab}; FlashInfer "
          f"{'available' if flashinfer_sampling.available(device) else 'not available'}")
    print(", ".join(f"warmup {w['dtype']}: {w['seconds']:.1f} s" for w in warmups))
    print(markdown(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device_name, vocab=args.vocab, warmup=warmups, results=results), f, indent=1)


if __name__ == "__main__":
    main()
