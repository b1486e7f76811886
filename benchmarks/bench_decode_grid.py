"""Decode attention of every available fast backend side by side, through compile_attn's backends, in one run.

bf16, the Llama-3.2-1B attention shape (``common``), page size 1 (``--page-size`` to change), KV slots shuffled, batch
1/16/64/256 x context 512/4096. Per backend and shape: the decode metadata is built for a graph bucket
(``init_forward_metadata_out_graph(in_capture=True)`` + ``_in_graph``), then the attention call
(``backend.forward``, which also stores the step's K/V) is captured in a CUDA graph and replayed
(``triton.testing.do_bench_cudagraph``, median). KV bandwidth = bytes of cached K and V read / time, as % of
``common.PEAK_TB_S``.

    python benchmarks/bench_decode_grid.py --backends fa3,flashinfer,triton --out grid.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from common import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, PEAK_TB_S, require_cuda
from compile_attn import AttentionLayer, ForwardBatch, KVCache, create_backend, forward_context

HQ, HKV, D = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
BATCHES, CONTEXTS = (1, 16, 64, 256), (512, 4096)


def bench_backend(name: str, page_size: int) -> list[dict]:
    layer = AttentionLayer(0, HQ, HKV, D)
    kv = KVCache(num_layers=1, num_kv_heads=HKV, head_dim=D, max_batch_size=max(BATCHES), max_context=max(CONTEXTS),
                 kv_cache_tokens=max(BATCHES) * max(CONTEXTS), page_size=page_size, dtype=torch.bfloat16, device="cuda")
    for buf in (*kv.pool.k_buffers, *kv.pool.v_buffers):
        buf.normal_()
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(kv.allocator.available, generator=gen).tolist()  # scatter pages over the pool
    kv.allocator._free = [kv.allocator._free[i] for i in perm]
    backend = create_backend(name, kv, [layer])
    backend.init_cuda_graph_state(max(BATCHES), max(BATCHES))
    rows = []
    for bs in BATCHES:
        for ctx in CONTEXTS:
            reqs = [kv.alloc_request() for _ in range(bs)]
            kv.alloc_extend(reqs, [ctx - 1] * bs)
            fb = ForwardBatch.build(req_pool_indices=reqs, prefix_lens=[ctx - 1] * bs, extend_lens=[1] * bs,
                                    out_cache_loc=kv.alloc_extend(reqs, [1] * bs), device="cuda")
            fb.graph_bucket = bs
            q = torch.randn(bs, HQ, D, dtype=torch.bfloat16, device="cuda")
            k = torch.randn(bs, HKV, D, dtype=torch.bfloat16, device="cuda")
            out = torch.empty_like(q)
            backend.init_forward_metadata_out_graph(fb, in_capture=True)
            backend.init_forward_metadata_in_graph(fb)
            with forward_context(fb, backend, graph_mode="full"):
                ms = triton.testing.do_bench_cudagraph(lambda: backend.forward(q, k, k, layer, fb, out),
                                                       return_mode="median")
            kv_bytes = 2 * bs * ctx * HKV * D * 2
            rows.append({"backend": backend.name, "bs": bs, "ctx": ctx, "us": ms * 1e3,
                         "kv_tbps": kv_bytes / (ms * 1e-3) / 1e12,
                         "pct_peak": 100 * kv_bytes / (ms * 1e-3) / 1e12 / PEAK_TB_S})
            for r in reqs:
                kv.free_request(r)
    return rows


def table(rows: list[dict]) -> str:
    names = list(dict.fromkeys(r["backend"] for r in rows))
    head = "| bs x ctx | " + " | ".join(f"{n} us (% of {PEAK_TB_S} TB/s)" for n in names) + " |"
    lines = [head, "|---" * (len(names) + 1) + "|"]
    for bs in BATCHES:
        for ctx in CONTEXTS:
            cells = [next(f"{r['us']:.1f} ({r['pct_peak']:.0f}%)" for r in rows
                          if r["backend"] == n and r["bs"] == bs and r["ctx"] == ctx) for n in names]
            lines.append(f"| {bs} x {ctx} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="fa3,flashinfer,triton")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    require_cuda("bench_decode_grid.py")
    rows = []
    for name in args.backends.split(","):
        try:
            rows += bench_backend(name, args.page_size)
        except Exception as exc:  # noqa: BLE001 - a missing optional backend: report and go on
            print(f"{name}: skipped ({type(exc).__name__}: {exc})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
