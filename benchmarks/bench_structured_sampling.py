"""Benchmark the sampling step with and without a grammar (structured outputs): ``rows`` x ``vocab`` logits (bf16,
random normal) sampled as the engine samples them (``sample`` / argmax), and the same with every row (or a
``--guided-fraction`` of the rows) under a JSON-schema grammar: the host fills the rows' bitmasks (xgrammar's
matchers, each in a different state of a JSON document), sends them in one host-to-device copy and
``apply_token_bitmask_`` masks the logits before sampling (``GuidedRows.apply``, what the engine runs).

Reported per case (greedy, temperature 0.7, top-k 50 + top-p 0.9), medians over ``--reps`` timed calls after
``--warmup`` untimed ones:

- ``plain ms``: the device time of sampling alone (CUDA events);
- ``guided ms``: the device time of copy + mask + sampling from a bitmask already filled on the host (CUDA events),
  and ``+ms``, its excess over ``plain`` (the issue's bound: <= 0.3 ms at 256 rows on an H100);
- ``fill ms``: the host time to fill the bitmasks (in the engine it runs while the device runs the forward, so it
  costs the step only where it outlasts the forward);
- ``step ms``: plain and guided wall time of fill + copy + mask + sampling with a synchronize (the whole thing,
  nothing overlapped);
- ``mask kernel ms``: ``apply_token_bitmask_`` alone from a device-resident bitmask with torch ops, and with
  xgrammar's kernel (``xgrammar ms``: its Triton kernel on a GPU, where Triton runs); the engine's "auto" takes
  xgrammar's on a GPU and torch ops elsewhere (the ``guided`` columns run "auto").

The vocabulary is synthetic (``--vocab`` strings of 1-8 characters over letters, digits and JSON punctuation, a
RAW xgrammar vocabulary) unless ``--tokenizer DIR`` names a Hugging Face tokenizer directory. On the CPU
(``--device cpu``) every time is a wall-clock median (no events), for a small smoke run:

    python benchmarks/bench_structured_sampling.py --out structured.json                   # GPU: 256 x 128256
    python benchmarks/bench_structured_sampling.py --device cpu --rows 8 --vocab 4096 --reps 5   # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable

import torch

from compile_attn.bench.decode_step import BenchConfig, _timed
from compile_attn.engine.execution.sampling.grammar import (GrammarCache, GuidedRows, apply_token_bitmask_,
                                                           bitmask_width)
from compile_attn.engine.execution.sampling.sampler import SamplingPlan, sample, warmup
from compile_attn.engine.requests.guided_decoding import GuidedDecodingParams

CASES: dict[str, tuple[float, int, float]] = {  # temperature, top_k, top_p
    "greedy": (0.0, 0, 1.0),
    "temperature 0.7": (0.7, 0, 1.0),
    "top-k 50 + top-p 0.9": (0.7, 50, 0.9),
}
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "maxLength": 40}, "tags": {"type": "array", "items": {"type": "string"}},
    "kind": {"enum": ["person", "company", "robot"]}, "active": {"type": "boolean"}},
    "required": ["name", "age", "kind", "tags", "active"]}
DOCUMENT = ('{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "notes"], '
            '"kind": "person", "active": true}')


def synthetic_vocab(size: int, seed: int = 0) -> list[str]:
    """``size`` distinct token strings: every printable ASCII character first, then strings of 2-8 characters drawn
    from letters, digits, spaces and JSON punctuation (the last one is the stop token's place)."""
    rng = random.Random(seed)
    chars = [chr(c) for c in range(32, 127)]
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789      \"{}[]:,._-@"
    vocab, seen = list(chars), set(chars)
    while len(vocab) < size - 1:
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))
        if s not in seen:
            seen.add(s)
            vocab.append(s)
    return vocab + ["</s>"]


def grammar_cache(vocab: int, tokenizer_dir: str | None) -> GrammarCache:
    import xgrammar as xgr

    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        return GrammarCache(AutoTokenizer.from_pretrained(tokenizer_dir), vocab)
    info = xgr.TokenizerInfo(synthetic_vocab(vocab), xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=[vocab - 1])
    return GrammarCache(info, vocab)


def guided_rows(cache: GrammarCache, rows: int, fraction: float) -> GuidedRows:
    """``rows`` sampled rows of which the first ``fraction`` (spread evenly) have a grammar, each matcher advanced
    through a different prefix of ``DOCUMENT``."""
    params = GuidedDecodingParams(json=SCHEMA)
    n = max(1, round(rows * fraction))
    at = sorted({round(i * rows / n) for i in range(n)})
    matchers = []
    for j, _ in enumerate(at):
        m = cache.matcher(params)
        prefix = DOCUMENT[: (j * 7919) % (len(DOCUMENT) - 1)]
        assert m.accept_string(prefix), prefix
        matchers.append(m)
    return GuidedRows(cache, at, matchers, rows)


def bench(rows: int, vocab: int, device: torch.device, rows_state: GuidedRows, reps: int, warm: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():  # the logits of an inference-mode forward, as in the engine
        logits = torch.randn(rows, vocab, generator=gen).to(device=device, dtype=torch.bfloat16)
    width = bitmask_width(vocab)
    g = len(rows_state.matchers)
    pin = device.type == "cuda"
    host = rows_state.fill_host(logits)  # filled once: the device-time cases copy this one (the engine's layout)
    every_row = g == rows
    dev_buf = rows_state.host_bitmask(width, pin).to(device)  # the G rows and their row indices: the kernels alone
    masked = logits.clone()
    # Medians of reps calls after warm untimed ones: CUDA events (device time) on a GPU, else wall clock; the
    # step times are wall clock with a synchronize around each call, the host's fill times wall clock.
    events = BenchConfig(device=device.type, iters=reps, warmup=warm)
    wall = BenchConfig(device=device.type, iters=reps, warmup=warm, wall_clock=True)
    on_host = BenchConfig(device="cpu", iters=reps, warmup=warm)

    def copy_and_mask() -> None:
        rows_state.mask(masked, host)

    def mask_kernel(backend: str) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():
                apply_token_bitmask_(masked, dev_buf[: g * width].view(g, width),
                                     None if every_row else dev_buf[g * width:], backend=backend)
        return run

    xgr_kernel: Callable[[], None] | None = mask_kernel("xgrammar")
    try:
        xgr_kernel()
    except Exception as exc:  # noqa: BLE001 - no Triton: not compared
        print(f"xgrammar's kernel not timed: {type(exc).__name__}: {exc}")
        xgr_kernel = None

    results = []
    for case, (t, k, p) in CASES.items():
        temperature = torch.full((rows,), t, device=device)
        top_k = torch.full((rows,), k, device=device, dtype=torch.int64) if k else None
        top_p = torch.full((rows,), p, device=device) if p < 1 else None
        seeds = torch.arange(rows, device=device)
        positions = torch.full((rows,), 100, device=device, dtype=torch.int64)
        plan = SamplingPlan.for_rows([t] * rows, [k] * rows, [p] * rows, [0.0] * rows, True)

        def pick(x: torch.Tensor) -> torch.Tensor:
            if t == 0:
                return x.argmax(dim=-1)  # the engine's all-greedy path
            return sample(x, temperature, top_k, top_p, seeds, positions, plan=plan)

        def guided_device() -> None:
            copy_and_mask()
            pick(masked)

        def guided_step() -> None:
            with torch.inference_mode():
                rows_state.apply(masked)
            pick(masked)

        r = dict(case=case, rows=rows, vocab=vocab, guided_rows=g, device=str(device))
        r["plain_ms"] = _timed(lambda: pick(logits), events)
        r["guided_ms"] = _timed(guided_device, events)
        r["excess_ms"] = r["guided_ms"] - r["plain_ms"]
        r["fill_ms"] = _timed(lambda: rows_state.fill_host(logits), on_host)
        r["plain_step_ms"] = _timed(lambda: pick(logits), wall)
        r["guided_step_ms"] = _timed(guided_step, wall)
        r["mask_kernel_ms"] = _timed(mask_kernel("torch"), events)
        r["xgrammar_kernel_ms"] = _timed(xgr_kernel, events) if xgr_kernel is not None else None
        results.append(r)
    return results


def markdown(results: list[dict]) -> str:
    lines = ["| case | rows (guided) | plain ms | guided ms | +ms | fill ms (host) | step ms plain / guided | "
             "mask kernel ms | xgrammar ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        xk = "-" if r["xgrammar_kernel_ms"] is None else f"{r['xgrammar_kernel_ms']:.3f}"
        lines.append(f"| {r['case']} | {r['rows']} ({r['guided_rows']}) | {r['plain_ms']:.3f} | {r['guided_ms']:.3f} "
                     f"| {r['excess_ms']:+.3f} | {r['fill_ms']:.3f} | {r['plain_step_ms']:.3f} / "
                     f"{r['guided_step_ms']:.3f} | {r['mask_kernel_ms']:.3f} | {xk} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[256])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--guided-fraction", type=float, nargs="+", default=[1.0, 0.5],
                        help="fractions of the rows that have a grammar (each a run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer directory (default: synthetic)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    t0 = time.perf_counter()
    cache = grammar_cache(args.vocab, args.tokenizer)
    cache.compile(GuidedDecodingParams(json=SCHEMA))
    compile_s = time.perf_counter() - t0
    if device.type == "cuda":
        warmup(device, args.vocab, max(args.rows), dtype=torch.bfloat16)  # the engine's start-up warm-up
    results = []
    for rows in args.rows:
        for fraction in args.guided_fraction:
            results += bench(rows, args.vocab, device, guided_rows(cache, rows, fraction), args.reps, args.warmup)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"sampling step with and without a JSON-schema grammar on {name}, vocab {args.vocab} "
          f"({'tokenizer ' + args.tokenizer if args.tokenizer else 'synthetic'}); tokenizer info + schema compile "
          f"{compile_s:.2f} s; times in ms, medians of {args.reps}")
    print(markdown(results))
    from compile_attn.engine.execution.sampling import grammar as grammar_module

    kernel = grammar_module._triton_kernel
    print("the engine's mask ('auto'): " + ("xgrammar's Triton kernel" if kernel is True else "torch ops"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=name, vocab=args.vocab, compile_s=compile_s, results=results), f, indent=1)


if __name__ == "__main__":
    main()
