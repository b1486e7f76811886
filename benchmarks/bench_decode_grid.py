"""Decode attention of every available fast backend side by side, through compile_attn's backends, in one run.

bf16, the Llama-3.2-1B attention shape (``common``), page size 1 (``--page-size`` to change), KV slots shuffled, batch
1/16/64/256 x context 512/4096. Per backend and shape: the decode metadata is built for a graph bucket
(``init_forward_metadata_out_graph(in_capture=True)`` + ``_in_graph``), then the attention call
(``backend.forward``, which also stores the step's K/V) is captured in a CUDA graph and replayed
(``triton.testing.do_bench_cudagraph``, median). KV bandwidth = bytes of cached K and V read / time, as % of
``common.PEAK_TB_S``.

``--kv-cache-dtypes bf16,fp8_e4m3`` times each backend over each cache dtype (an fp8 cache holds random values with
per-head scales set in the pool, as a calibrated cache does; its bytes count one per element) and adds each dtype's
speed-up over the first; ``--cases 64x4096,256x4096`` picks the shapes.

    python benchmarks/bench_decode_grid.py --backends fa3,flashinfer,triton --out grid.json
    python benchmarks/bench_decode_grid.py --kv-cache-dtypes bf16,fp8_e4m3 --cases 64x4096,256x4096
"""

from __future__ import annotations

import argparse
import array
import json

import torch
import triton.testing

from common import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, PEAK_TB_S, require_cuda
from compile_attn import AttentionLayer, ForwardBatch, KVCache, create_backend, forward_context
from compile_attn.kv.kv_scales import KVScales, apply_scales

HQ, HKV, D = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
BATCHES, CONTEXTS = (1, 16, 64, 256), (512, 4096)
KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _fill(kv: KVCache) -> None:
    """Random K/V (an fp8 pool: N(0, 1) values stored with per-head scales of 4 / the format's max, so they span
    its range as a calibrated cache's do)."""
    pool = kv.pool
    for buf in (*pool.k_buffers, *pool.v_buffers):
        if pool.quantized:
            fmax = torch.finfo(pool.dtype).max
            buf.view(pool.dtype).copy_(torch.randn(buf.shape, device=buf.device).mul_(fmax / 4).clamp_(-fmax, fmax))
        else:
            buf.normal_()
    if pool.quantized:
        scale = [torch.full((HKV,), 4 / torch.finfo(pool.dtype).max, device="cuda")]
        apply_scales(pool, KVScales(k=scale, v=scale, source="benchmark"))


def bench_backend(name: str, page_size: int, kv_dtype: str = "bf16", cases: list[tuple[int, int]] | None = None
                  ) -> list[dict]:
    cases = cases or [(bs, ctx) for bs in BATCHES for ctx in CONTEXTS]
    max_bs, max_ctx = max(bs for bs, _ in cases), max(ctx for _, ctx in cases)
    layer = AttentionLayer(0, HQ, HKV, D)
    dtype = KV_DTYPES[kv_dtype]
    kv = KVCache(num_layers=1, num_kv_heads=HKV, head_dim=D, max_batch_size=max_bs, max_context=max_ctx,
                 kv_cache_tokens=max_bs * max_ctx, page_size=page_size, dtype=dtype, device="cuda")
    _fill(kv)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(kv.allocator.available, generator=gen).tolist()  # scatter pages over the pool
    kv.allocator._free = array.array("q", [kv.allocator._free[i] for i in perm])
    backend = create_backend(name, kv, [layer])
    backend.init_cuda_graph_state(max_bs, max_bs)
    rows = []
    for bs, ctx in cases:
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
        kv_bytes = 2 * bs * ctx * HKV * D * dtype.itemsize
        rows.append({"backend": backend.name, "kv_dtype": kv_dtype, "bs": bs, "ctx": ctx, "us": ms * 1e3,
                     "kv_tbps": kv_bytes / (ms * 1e-3) / 1e12,
                     "pct_peak": 100 * kv_bytes / (ms * 1e-3) / 1e12 / PEAK_TB_S})
        for r in reqs:
            kv.free_request(r)
    return rows


def table(rows: list[dict]) -> str:
    """One row per shape, one column per (backend, cache dtype): us (% of peak bandwidth) [speed-up over the first
    dtype of that backend]."""
    cols = list(dict.fromkeys((r["backend"], r["kv_dtype"]) for r in rows))
    shapes = list(dict.fromkeys((r["bs"], r["ctx"]) for r in rows))
    by = {(r["backend"], r["kv_dtype"], r["bs"], r["ctx"]): r for r in rows}
    head = "| bs x ctx | " + " | ".join(f"{n} {dt} us (% of {PEAK_TB_S} TB/s)" for n, dt in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    for bs, ctx in shapes:
        cells = []
        for n, dt in cols:
            r = by.get((n, dt, bs, ctx))
            first = by.get((n, next(d for m, d in cols if m == n), bs, ctx))
            gain = f" [{first['us'] / r['us']:.2f}x]" if r and first and first is not r else ""
            cells.append("-" if r is None else f"{r['us']:.1f} ({r['pct_peak']:.0f}%){gain}")
        lines.append(f"| {bs} x {ctx} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="fa3,flashinfer,triton")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--kv-cache-dtypes", default="bf16", help=f"comma-separated, first = baseline ({', '.join(KV_DTYPES)})")
    parser.add_argument("--cases", default=None, help="comma-separated BSxCTX (default: 1/16/64/256 x 512/4096)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dtypes = args.kv_cache_dtypes.split(",")
    for dt in dtypes:
        if dt not in KV_DTYPES:
            parser.error(f"--kv-cache-dtypes: unknown {dt!r}; choose from {', '.join(KV_DTYPES)}")
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")] if args.cases else None
    require_cuda("bench_decode_grid.py")
    rows = []
    for name in args.backends.split(","):
        for dt in dtypes:
            try:
                rows += bench_backend(name, args.page_size, dt, cases)
            except Exception as exc:  # noqa: BLE001 - a missing optional backend or dtype: report and go on
                print(f"{name} {dt}: skipped ({type(exc).__name__}: {str(exc)[:200]})")
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
