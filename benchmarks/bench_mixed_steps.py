"""Mixed steps of any size: step time and share of peak bf16 FLOP/s for one prefill chunk of C tokens beside D
decoding rows, through the engine's graph runner.

For every D in ``--decode-rows`` (requests with ``--context`` cached tokens each, one new token) and every chunk C in
``--chunks`` (not only powers of two), one step of C + D tokens runs through ``GraphRunner.run`` (the route the engine
takes: the piecewise graphs of the next extend bucket, the chunk padded up to it) and, with ``--exact``, through
``GraphRunner.run_eager`` (the same compiled pieces at the exact token count, no CUDA graphs), CUDA-event medians.
The LM head is not in either (the engine runs it on the sampled rows only). FLOPs: 2 x (non-embedding parameters) x
tokens for the linear layers, plus attention (the chunk's causal C x C / 2 and each decode row's ``--context``).

    python benchmarks/bench_mixed_steps.py --decode-rows 0,64,256 --exact --out mixed_steps.json
    python benchmarks/bench_mixed_steps.py --tiny        # a CPU smoke run (small sizes by default)

Random bf16 weights of the Llama-3.2-1B shape (``LLAMA_1B``), triton, 8,192 tokens per step at most.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from common import LLAMA_1B, PEAK_BF16_FLOPS, TINY

from compile_attn import ForwardBatch
from compile_attn.bench import decode_step as bench
from compile_attn.bench.run_info import run_info
from compile_attn.engine import LLM
from compile_attn.graph_runner.replay_view import next_bucket

CHUNKS = "256,512,768,1024,1536,2048,2600,3072,4096,4200,5120,6144,7168,8192"
# The sizes an option left unset takes: on the GPU, and with --tiny (a CPU smoke run of a few graphs, about a minute).
DEFAULTS = dict(chunks=CHUNKS, decode_rows="0,64,256", context=1000, max_num_tokens=8192)
TINY_DEFAULTS = dict(chunks="16,40,64", decode_rows="0,4", context=64, max_num_tokens=128)


def step_flops(shape: dict, chunk: int, rows: int, context: int) -> float:
    """FLOPs of one step: the linear layers over every token, attention over the chunk (causal) and the rows."""
    h, layers, heads, d = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"], shape["head_dim"]
    kv = shape["num_key_value_heads"]
    per_layer = h * (heads * d + 2 * kv * d) + heads * d * h + 3 * h * shape["intermediate_size"]
    linear = 2 * layers * per_layer * (chunk + rows)
    attention = layers * 4 * heads * d * (chunk * (chunk + 1) / 2 + rows * (context + 1))
    return linear + attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", help=f"prefill chunk sizes (default {CHUNKS}; --tiny: {TINY_DEFAULTS['chunks']})")
    ap.add_argument("--decode-rows", help=f"decoding rows beside the chunk (default {DEFAULTS['decode_rows']}; "
                                          f"--tiny: {TINY_DEFAULTS['decode_rows']})")
    ap.add_argument("--context", type=int, help=f"cached tokens of each decoding row (default {DEFAULTS['context']}; "
                                                f"--tiny: {TINY_DEFAULTS['context']})")
    ap.add_argument("--max-num-tokens", type=int, help=f"tokens per step at most (default "
                                                       f"{DEFAULTS['max_num_tokens']}; --tiny: "
                                                       f"{TINY_DEFAULTS['max_num_tokens']})")
    ap.add_argument("--exact", action="store_true", help="also time the exact token count without graphs")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (smoke run)")
    ap.add_argument("--out")
    args = ap.parse_args()
    for name, value in (TINY_DEFAULTS if args.tiny else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    device = "cpu" if args.tiny else "cuda"
    shape = dict(TINY if args.tiny else LLAMA_1B)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    chunks = [int(c) for c in args.chunks.split(",")]
    row_counts = [int(d) for d in args.decode_rows.split(",")]
    context = min(args.context, shape["max_position_embeddings"] - 2)
    max_rows = max(row_counts) + 1
    model = bench._hf_model(bench.BenchConfig(shape=shape, device=device), "sdpa", dtype)
    llm = LLM(model, attn_backend="torch_native" if args.tiny else args.backend, device=device, dtype=dtype,
              max_batch_size=max_rows, max_num_tokens=args.max_num_tokens, max_context=max(context + 2, max(chunks)),
              kv_cache_tokens=max_rows * (context + 2) + args.max_num_tokens + 64,
              **({"graph_mode": "full_and_piecewise", "compile": False} if args.tiny else {}))
    kv, runner = llm.kv_cache, llm.step_runner.runner
    timing = bench.BenchConfig(device=device, iters=args.iters, warmup=3)
    gen = torch.Generator().manual_seed(0)
    results = []
    for d in row_counts:
        rows = [kv.alloc_request() for _ in range(d)]
        if rows:
            kv.alloc_extend(rows, [context] * d)
        for c in chunks:
            if c + d > args.max_num_tokens:
                continue
            prefill = kv.alloc_request()
            reqs, prefix, extend = [*rows, prefill], [context] * d + [0], [1] * d + [c]
            loc = kv.alloc_extend(reqs, extend)
            ids = torch.randint(0, shape["vocab_size"], (c + d,), generator=gen).tolist()
            fb = ForwardBatch.build(req_pool_indices=reqs, prefix_lens=prefix, extend_lens=extend, out_cache_loc=loc,
                                    input_ids=ids, device=device)
            graph_ms = bench._timed(lambda: runner.run(fb), timing)
            exact_ms = bench._timed(lambda: runner.run_eager(fb), timing) if args.exact else None
            flops = step_flops(shape, c, d, context)
            row = dict(decode_rows=d, chunk=c, tokens=c + d, bucket=next_bucket(runner.extend_buckets, c + d),
                       graph_ms=graph_ms, exact_ms=exact_ms, tflops=flops / 1e12,
                       graph_peak=flops / (graph_ms * 1e-3) / PEAK_BF16_FLOPS,
                       exact_peak=None if exact_ms is None else flops / (exact_ms * 1e-3) / PEAK_BF16_FLOPS)
            results.append(row)
            print(f"D {d:4d} C {c:5d} (bucket {row['bucket']}): graphs {graph_ms:.3f} ms "
                  f"({100 * row['graph_peak']:.0f}% of peak)"
                  + ("" if exact_ms is None else f", exact {exact_ms:.3f} ms ({100 * row['exact_peak']:.0f}%)"),
                  flush=True)
            kv.free_requests([prefill])
            for r in rows:
                kv.truncate(r, context)
        kv.free_requests(rows)
    print("\n| decode rows | chunk | bucket | graphs ms | % of peak | exact ms | % of peak |\n|---|---|---|---|---|---|---|")
    for r in results:
        exact = "-" if r["exact_ms"] is None else f"{r['exact_ms']:.3f} | {100 * r['exact_peak']:.0f}%"
        print(f"| {r['decode_rows']} | {r['chunk']} | {r['bucket']} | {r['graph_ms']:.3f} | "
              f"{100 * r['graph_peak']:.0f}% | {exact if r['exact_ms'] is not None else '- | -'} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(run_info=run_info(sys.argv), args=vars(args), rows=results), indent=1))


if __name__ == "__main__":
    main()
