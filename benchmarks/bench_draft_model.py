"""Draft-model speculative decoding on one GPU: what a proposal costs against the draft's own decode steps, and the
target's verify step against its decode step, in one run; with an acceptance measured elsewhere
(examples/speculative_acceptance.py), the projected speedup.

* Draft cost: ``DraftModelProposer.propose`` for B requests of ``--context`` tokens in steady state (each request
  feeds one token, then K - 1 decode steps; the K drafts copied to the host once), wall-clock median after a device
  sync, against K x the draft's decode step of B requests (CUDA-event median of its graph replay). Target <= 1.1x.
* Target steps: the decode step of B requests and the chain verify step of B x (1 + K) tokens (full decode graphs).
* Projection: a request gains ``L`` tokens per verify step (L = ``--accepted-length``, the mean accepted length),
  so tokens per second scale by L x decode / (draft + verify).

Random bf16 weights: the target of the Llama-3.1-8B shape, the draft of the Llama-3.2-1B shape (``--tiny``: two
tiny models on the CPU, a smoke run). Prints a markdown table; ``--out`` writes the JSON.

    python benchmarks/bench_draft_model.py --out benchmarks/results/speculative/draft_h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compile_attn import ForwardBatch  # noqa: E402
from compile_attn.bench import decode_step as bench  # noqa: E402
from compile_attn.bench.run_info import run_info  # noqa: E402
from compile_attn.engine import LLM  # noqa: E402
from compile_attn.engine.requests.request import Request  # noqa: E402
from compile_attn.engine.requests.sampling_params import SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import median_ms, step_times, sync  # noqa: E402

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                max_position_embeddings=8192)
TINY_DRAFT = dict(bench.TINY, num_hidden_layers=1)


def draft_times(llm: LLM, bs: int, context: int, iters: int, device: str, vocab: int) -> dict:
    """A proposal for ``bs`` requests of ``context`` tokens (steady state) against K draft decode steps."""
    draft = llm.speculator.draft
    k = draft.k
    gen = torch.Generator().manual_seed(bs)
    reqs = [Request(10_000 + i, torch.randint(0, vocab, (context,), generator=gen).tolist(), SamplingParams(),
                    seed=0)
            for i in range(bs)]
    draft.propose(reqs, [k] * bs)  # first call: each request's whole context is fed (the catch-up)
    walls = []
    for _ in range(iters + 5):
        sync(device)
        t0 = time.perf_counter()
        draft.propose(reqs, [k] * bs)  # the drafts past each request's last token are cut and drafted again
        sync(device)
        walls.append(1e3 * (time.perf_counter() - t0))
    propose_ms = statistics.median(walls[5:])
    # One draft decode step of the same rows: each request's last token again over its own slot.
    kv, rows = draft.kv_cache, [draft._rows[r.request_id].row for r in reqs]
    for r in rows:
        kv.truncate(r, context - 1)
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[context - 1] * bs, extend_lens=[1] * bs,
                            out_cache_loc=kv.alloc_extend(rows, [1] * bs),
                            input_ids=[r.token_ids[-1] for r in reqs], device=device)
    decode_ms = median_ms(lambda: draft.runner.run(fb, None), device, iters)
    draft.forget(set())
    return dict(batch_size=bs, k=k, context=context, propose_ms=propose_ms, draft_decode_ms=decode_ms,
                ratio=propose_ms / (k * decode_ms))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--accepted-length", type=float, default=None,
                    help="mean accepted length per verify step to project the speedup with")
    ap.add_argument("--tiny", action="store_true", help="two tiny models on the CPU (smoke run)")
    ap.add_argument("--out")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    target_shape, draft_shape = (bench.TINY, TINY_DRAFT) if args.tiny else (LLAMA_8B, bench.LLAMA_1B)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    make = lambda shape: bench._hf_model(bench.BenchConfig(shape=dict(shape), device=device), "sdpa", dtype)  # noqa: E731
    options = dict(attn_backend=args.backend if not args.tiny else "torch_native", device=device, dtype=dtype,
                   max_batch_size=max(sizes), max_num_tokens=max(2048, max(sizes) * (args.k + 1)),
                   max_context=args.context + 2 * args.k + 8,
                   kv_cache_tokens=2 * max(sizes) * (args.context + 2 * args.k + 16) + 4096,
                   compile_options={"cache_dir": None},
                   speculative_config={"method": "draft_model", "model": make(draft_shape),
                                       "num_speculative_tokens": args.k})
    if args.tiny:
        options.update(graph_mode="full", compile=False)
    llm = LLM(make(target_shape), **options)
    result = dict(run_info=run_info(sys.argv), args=vars(args), draft=[], target=[])
    for bs in sizes:
        result["draft"].append(draft_times(llm, bs, args.context, args.iters, device, target_shape["vocab_size"]))
    result["target"] = step_times(llm, sizes, args.k, args.context, args.iters, device, target_shape["vocab_size"])
    print("| B | K draft steps (propose) ms | K x draft decode ms | ratio | target decode ms | verify ms | "
          "projected speedup |\n|---|---|---|---|---|---|---|")
    for d, t in zip(result["draft"], result["target"]):
        step = d["propose_ms"] + t["verify_ms"]
        d["projected_speedup"] = (args.accepted_length * t["decode_ms"] / step) if args.accepted_length else None
        proj = f"{d['projected_speedup']:.2f}x" if args.accepted_length else "-"
        print(f"| {d['batch_size']} | {d['propose_ms']:.3f} | {args.k * d['draft_decode_ms']:.3f} | "
              f"{d['ratio']:.2f} | {t['decode_ms']:.3f} | {t['verify_ms']:.3f} | {proj} |", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
