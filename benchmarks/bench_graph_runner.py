"""GraphRunner cost and benefit on the Llama-3.2-1B-shaped ToyDecoder (random bf16 weights).

Reports (1) capture time and graph memory of FULL decode graphs for the default decode buckets
(1, 2, 4, 8, 16, 24, ..., 256) and (2) decode step time at batch sizes 1/16/64 per mode (eager,
full, breakable), each request with ``--context`` cached tokens. A step is ``GraphRunner.run``
(padding copies, out_graph metadata, replay); times are the median over ``--repeats`` runs of the
mean of ``--iters`` back-to-back steps, synchronised at the end. Prints a table, writes JSON.

    python benchmarks/bench_graph_runner.py --out graph_runner.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from compile_attn import ForwardBatch, KVCache, create_backend
from compile_attn.config import GraphConfig
from compile_attn.graph_runner import GraphRunner
from compile_attn.models import ToyDecoder, ToyDecoderConfig

LLAMA_1B = ToyDecoderConfig(
    vocab_size=128256,
    hidden_size=2048,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    intermediate_size=8192,
)


def decode_batch(kv: KVCache, bs: int, context: int, vocab: int) -> ForwardBatch:
    rows = [kv.alloc_request() for _ in range(bs)]
    kv.alloc_extend(rows, [context] * bs)
    loc = kv.alloc_extend(rows, [1] * bs)
    ids = torch.randint(0, vocab, (bs,)).tolist()
    return ForwardBatch.build(
        req_pool_indices=rows,
        prefix_lens=[context] * bs,
        extend_lens=[1] * bs,
        out_cache_loc=loc,
        input_ids=ids,
        device=kv.device,
    )


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_ms(fn, iters: int, repeats: int) -> float:
    for _ in range(3):
        fn()
    _sync()
    means = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync()
        means.append((time.perf_counter() - t0) / iters * 1e3)
    return statistics.median(means)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="torch_native")
    ap.add_argument("--context", type=int, default=256, help="cached tokens per request in the decode timing")
    ap.add_argument(
        "--max-context", type=int, default=512, help="KV cache max_context (torch_native's graph width)"
    )
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--tiny", action="store_true", help="a tiny model on whatever device there is (smoke test)"
    )
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = ToyDecoderConfig() if args.tiny else LLAMA_1B
    with torch.device(device):
        model = ToyDecoder(cfg).to(torch.bfloat16).eval()
    max_bs = 256
    kv = KVCache(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_requests=max_bs,
        max_context=args.max_context,
        num_tokens=max_bs * args.max_context,
        dtype=torch.bfloat16,
        device=device,
    )
    layers = model.attention_layers()
    result: dict = {
        "model": "ToyDecoder Llama-3.2-1B shape, bf16",
        "backend": args.backend,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "context": args.context,
        "max_context": args.max_context,
    }

    # (1) FULL decode graphs, default buckets; one backend per runner (init_cuda_graph_state is per runner)
    full = GraphRunner(
        model,
        create_backend(args.backend, kv, layers),
        GraphConfig(mode="full", cache_dir=None),
        max_batch_size=max_bs,
        max_num_tokens=max_bs,
    )
    stats = full.capture()
    result["full_capture"] = {
        "buckets": len(full.decode_buckets),
        "seconds": round(stats.capture_seconds, 2),
        "graph_memory_mib": round(stats.graph_memory_bytes / 2**20, 1),
    }

    # (2) step time per mode
    small = GraphConfig(mode="breakable", decode_batch_sizes=tuple(batch_sizes), cache_dir=None)
    breakable = GraphRunner(
        model,
        create_backend(args.backend, kv, layers),
        small,
        max_batch_size=max(batch_sizes),
        max_num_tokens=max(batch_sizes),
    )
    bstats = breakable.capture()
    result["breakable_capture"] = {
        "graphs": len(breakable.capture_keys()),
        "seconds": round(bstats.capture_seconds, 2),
        "graph_memory_mib": round(bstats.graph_memory_bytes / 2**20, 1),
        "segments": bstats.segments,
        "breaks": bstats.breaks,
    }
    result["decode_step_ms"] = {}
    for bs in batch_sizes:
        fb = decode_batch(kv, bs, args.context, cfg.vocab_size)
        row = {
            "eager": step_ms(lambda fb=fb: full.run_eager(fb), args.iters, args.repeats),
            "full": step_ms(lambda fb=fb: full.run(fb), args.iters, args.repeats),
            "breakable": step_ms(lambda fb=fb: breakable.run(fb), args.iters, args.repeats),
        }
        eager_out = full.run_eager(fb).float()
        scale = float(eager_out.abs().max())
        row["full_vs_eager_max_rel_err"] = float((full.run(fb).float() - eager_out).abs().max()) / scale
        row["breakable_vs_eager_max_rel_err"] = (
            float((breakable.run(fb).float() - eager_out).abs().max()) / scale
        )
        result["decode_step_ms"][bs] = {k: v if "err" in k else round(v, 3) for k, v in row.items()}
    assert full.stats.eager_fallbacks == 0 and breakable.stats.eager_fallbacks == 0

    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result))
    fc = result["full_capture"]
    print(
        f"\nFULL capture, {fc['buckets']} decode buckets: {fc['seconds']} s, {fc['graph_memory_mib']} MiB graph memory"
    )
    bc = result["breakable_capture"]
    print(
        f"BREAKABLE capture, {bc['graphs']} graphs: {bc['seconds']} s, {bc['graph_memory_mib']} MiB, "
        f"{bc['segments']} segments / {bc['breaks']} breaks"
    )
    print(f"\ndecode step (ms), {args.backend}, context {args.context}")
    print(
        "| bs | eager | full | breakable | full vs eager (rel) | breakable vs eager (rel) |\n|---|---|---|---|---|---|"
    )
    for bs, row in result["decode_step_ms"].items():
        print(
            f"| {bs} | {row['eager']} | {row['full']} | {row['breakable']} | "
            f"{row['full_vs_eager_max_rel_err']:.2e} | {row['breakable_vs_eager_max_rel_err']:.2e} |"
        )


if __name__ == "__main__":
    main()
