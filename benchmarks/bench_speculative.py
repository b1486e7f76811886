"""Speculative decoding on one GPU: the verify step against the decode step, and output tokens/s with speculation
against without, in one run.

* Step times (``--step-batch-sizes``): a chain verify step of B requests x (1 + K) tokens against the decode step of
  B requests on the same KV cache (``context`` cached tokens per request), CUDA-event medians. The verify step runs
  through the engine's route: its full verify graph where the backend has a verify mode (triton: each request's
  prefix read once for its 1 + K tokens; ``verify_graph_runs`` counts them), and, for comparison, as B x (1 + K)
  decode rows in the full decode graphs (``verify_rows_ms``: the route before verify graphs, and still the route of
  steps whose requests verify different draft counts). The verify mode is the library's default
  (``COMPILE_ATTN_VERIFY_MODE=0``: decode rows only; the script then times only that route).
* Output tokens/s (``--batch-sizes``): B random prompts, greedy, ``--max-new-tokens`` each, through ``LLM.generate``:
  no speculation (overlap on, the default a user gets), speculation with a proposer that is always right (it
  replays the greedy continuation of the run before: the mechanism's ceiling, test-only), and prompt lookup
  ("ngram"). The share of requests whose tokens equal the plain run's is reported: in bf16 a verify step's other
  GEMM shapes round differently, which can flip a near-tie of random weights' logits (fp32 runs are identical:
  tests/engine/execution/speculative). Where a batch's replay still diverges (at batch 64 every pass flips a few
  requests, whose later drafts then all miss), ``--force-accept B,...`` measures those batch sizes' ceiling with
  acceptance forced (benchmark-only: every draft kept, plus the target's token after them): the steps, the KV
  writes and the host work are those of an always-right proposer; the tokens are not the model's greedy ones.

Random bf16 weights of the Llama-3.2-1B shape unless ``--tiny`` (a CPU smoke run). Prints a markdown table; ``--out``
writes the JSON.

    python benchmarks/bench_speculative.py --out benchmarks/results/speculative/h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compile_attn import ForwardBatch, ForwardMode  # noqa: E402
from compile_attn.bench import decode_step as bench  # noqa: E402
from compile_attn.bench.run_info import run_info  # noqa: E402
from compile_attn.engine import LLM, SamplingParams  # noqa: E402
from compile_attn.engine.execution.speculative import speculator as speculator_module  # noqa: E402
from compile_attn.engine.execution.speculative.acceptance import accept_chain  # noqa: E402


def forced_acceptance(drafts, targets) -> list[int]:  # noqa: ANN001
    """Benchmark-only stand-in for ``accept_chain``: every draft kept, then the target's token after them."""
    return list(drafts) + [targets[len(drafts)]]


class ReplayProposer:
    """Test-only: proposes the known greedy continuation of each prompt (always right)."""

    def __init__(self, sequences: list[list[int]], k: int, key_len: int) -> None:
        self.k, self.key_len = k, key_len
        self.by_key = {tuple(s[:key_len]): s for s in sequences}

    def propose(self, token_ids, max_tokens: int | None = None) -> list[int]:  # noqa: ANN001
        full = self.by_key[tuple(token_ids[: self.key_len])]
        n = self.k if max_tokens is None else min(self.k, max_tokens)
        return list(full[len(token_ids) : len(token_ids) + n])


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_ms(fn, device: str, iters: int) -> float:  # noqa: ANN001
    """CUDA-event (CPU: wall-clock) median of ``fn``, as ``compile-attn bench`` times a step."""
    return bench._timed(fn, bench.BenchConfig(device=device, iters=iters, warmup=5))


def step_times(llm: LLM, batch_sizes: list[int], k: int, context: int, iters: int, device: str,
               vocab: int) -> list[dict]:
    """Decode step (B rows) and chain verify step (B x (1 + K) rows) through ``llm``'s graph runner."""
    kv, runner, out = llm.kv_cache, llm.step_runner, []
    for bs in batch_sizes:
        rows = [kv.alloc_request() for _ in range(bs)]
        kv.alloc_extend(rows, [context] * bs)
        ids = torch.randint(0, vocab, (bs * (k + 1),)).tolist()
        before = dict(runner.runner.stats.runs)
        decode = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[context] * bs, extend_lens=[1] * bs,
                                    out_cache_loc=kv.alloc_extend(rows, [1] * bs), input_ids=ids[:bs], device=device)
        decode_ms = median_ms(lambda: runner.run(decode, None), device, iters)
        for r in rows:
            kv.truncate(r, context)
        verify = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[context] * bs, extend_lens=[k + 1] * bs,
                                    out_cache_loc=kv.alloc_extend(rows, [k + 1] * bs), input_ids=ids, device=device,
                                    forward_mode=ForwardMode.TARGET_VERIFY)
        graph_runs = runner.runner.stats.verify_runs
        verify_ms = median_ms(lambda: runner.run(verify, None), device, iters)
        graph_runs = runner.runner.stats.verify_runs - graph_runs
        buckets, runner.runner.verify_buckets = runner.runner.verify_buckets, ()  # internal: the decode-row route
        try:
            rows_ms = median_ms(lambda: runner.run(verify, None), device, iters)
        finally:
            runner.runner.verify_buckets = buckets
        full = runner.runner.stats.runs.get("full", 0) - before.get("full", 0)
        kv.free_requests(rows)
        out.append(dict(batch_size=bs, k=k, context=context, decode_ms=decode_ms, verify_ms=verify_ms,
                        verify_rows_ms=rows_ms, ratio=verify_ms / decode_ms, rows_ratio=rows_ms / decode_ms,
                        verify_graph_runs=graph_runs, full_graph_runs=full, runs=3 * (iters + 5)))
    return out


def throughput(llm: LLM, prompts: list[list[int]], new: int, device: str) -> tuple[float, list[list[int]], int]:
    llm.generate(prompts[:1], SamplingParams(max_new_tokens=4, ignore_eos=True), use_tqdm=False)  # warm
    sync(device)
    steps = llm.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True), use_tqdm=False)
    sync(device)
    seconds = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / seconds, [o.token_ids for o in outs], llm.num_steps - steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--step-batch-sizes", default="1,64")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--compile-sizes", default=None,
                    help="GraphConfig.compile_sizes, e.g. 1,8 (static compiles at the verify bucket too)")
    ap.add_argument("--force-accept", default="",
                    help="batch sizes whose always-right ceiling is measured with acceptance forced (see above)")
    ap.add_argument("--steps-only", action="store_true", help="the step times only")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (smoke run)")
    ap.add_argument("--out")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    shape = bench.TINY if args.tiny else bench.LLAMA_1B
    dtype = torch.float32 if args.tiny else torch.bfloat16
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    step_sizes = [int(x) for x in args.step_batch_sizes.split(",")]
    base = dict(attn_backend=args.backend if not args.tiny else "torch_native", device=device, dtype=dtype,
                max_batch_size=max(sizes + step_sizes), max_num_tokens=max(2048, max(sizes) * (args.k + 1)),
                max_context=max(args.context, args.prompt_len + args.max_new_tokens) + args.k + 8,
                kv_cache_tokens=max(sizes + step_sizes) * (max(args.context, args.prompt_len + args.max_new_tokens)
                                                           + 2 * args.k + 16) + 4096,
                compile_options={"cache_dir": None} if args.compile_sizes is None else
                {"cache_dir": None, "compile_sizes": tuple(int(x) for x in args.compile_sizes.split(","))})
    if args.tiny:
        base.update(graph_mode="full", compile=False)
    gen = torch.Generator().manual_seed(0)
    result = dict(run_info=run_info(sys.argv), args=vars(args), steps=[], throughput=[])
    make = lambda: bench._hf_model(bench.BenchConfig(shape=dict(shape), device=device), "sdpa", dtype)  # noqa: E731
    plain = None if args.steps_only else LLM(make(), **base)  # each engine its own model instance (same weights)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    spec = LLM(make(), speculative_config=ngram, **base)
    result["steps"] = step_times(spec, step_sizes, args.k, args.context, args.iters, device, shape["vocab_size"])
    print("| B | verify B x (1+K) ms | as decode rows ms | decode B ms | ratio | rows ratio | verify graph runs |\n"
          "|---|---|---|---|---|---|---|")
    for s in result["steps"]:
        print(f"| {s['batch_size']} | {s['verify_ms']:.3f} | {s['verify_rows_ms']:.3f} | {s['decode_ms']:.3f} | "
              f"{s['ratio']:.2f} | {s['rows_ratio']:.2f} | {s['verify_graph_runs']} |", flush=True)
    lookup = spec.speculator.proposer
    forced_sizes = {int(b) for b in args.force_accept.split(",") if b}
    for bs in [] if args.steps_only else sizes:
        prompts = [torch.randint(0, shape["vocab_size"], (args.prompt_len,), generator=gen).tolist() for _ in range(bs)]
        tps, ref, steps = throughput(plain, prompts, args.max_new_tokens, device)
        result["throughput"].append(dict(batch_size=bs, system="no speculation (overlap)", tok_s=tps, steps=steps))
        # The always-right proposer replays a continuation; in bf16 a verify step's rounding (other GEMM shapes) can
        # flip a near-tie, so it replays the previous speculative run's own tokens (a second pass is measured).
        known = ref
        forced = bs in forced_sizes
        for name, passes in (("always-right proposer" + (" (acceptance forced)" if forced else ""), 2),
                             ("ngram (prompt lookup)", 1)):
            for _ in range(passes):
                spec.speculator.proposer = (ReplayProposer([p + r for p, r in zip(prompts, known)], args.k, 32)
                                            if passes == 2 else lookup)
                speculator_module.accept_chain = forced_acceptance if forced and passes == 2 else accept_chain
                before = spec.speculator.stats.as_dict()
                try:
                    tps_s, got, steps_s = throughput(spec, prompts, args.max_new_tokens, device)
                finally:
                    speculator_module.accept_chain = accept_chain
                after = spec.speculator.stats.as_dict()
                known = ref if forced else got  # forced: both passes replay the plain run
            same = sum(g == r for g, r in zip(got, ref)) / len(ref)
            verified = after["verified_requests"] - before["verified_requests"]
            accepted = after["accepted_tokens"] - before["accepted_tokens"]
            row = dict(batch_size=bs, system=f"K={args.k}, {name}", tok_s=tps_s, steps=steps_s, speedup=tps_s / tps,
                       mean_accepted_length=1 + accepted / max(verified, 1), same_tokens_as_plain=same)
            result["throughput"].append(row)
            print(row, flush=True)
    print("\n| B | system | output tok/s | steps | speedup | accepted length | outputs = plain |")
    print("|---|---|---|---|---|---|---|")
    for t in result["throughput"]:
        print(f"| {t['batch_size']} | {t['system']} | {t['tok_s']:.0f} | {t['steps']} | {t.get('speedup', 1):.2f}x "
              f"| {t.get('mean_accepted_length', 1):.2f} | {100 * t.get('same_tokens_as_plain', 1):.0f}% |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
