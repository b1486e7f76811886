"""Benchmark the flashinfer backend on one GPU: decode attention, plan cost, extend paths, JIT warm-up, and
the decode step of a Llama-3.2-1B-shaped model in full-graph mode. Prints a markdown table, writes JSON.

Decode attention: bf16, the Llama-3.2-1B attention shape (``common``), page 1, batch 1/16/64/256 x context 512/4096,
through the backend (``decode_attention`` after the plan; the plan is not timed). "eager" times each
call with triton's do_bench, "graph" replays it captured in a CUDA graph (do_bench_cudagraph), both
medians. KV bandwidth = bytes of K and V read / graph time, as % of ``common.PEAK_TB_S``.

    python benchmarks/bench_flashinfer_decode.py --out bench.json            # everything
    python benchmarks/bench_flashinfer_decode.py --only jit --jit-label cached  # JIT warm-up time only
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import triton.testing

from common import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, PEAK_TB_S, require_cuda, toy_decoder_config
from compile_attn import AttentionLayer, ForwardBatch, KVCache, create_backend, forward_context

HQ, HKV, D = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
BATCHES, CONTEXTS = (1, 16, 64, 256), (512, 4096)


def _median_host_seconds(fn: Callable[[], object], reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _decode_batch(kv: KVCache, bs: int, ctx: int) -> tuple[list[int], ForwardBatch]:
    rows = [kv.alloc_request() for _ in range(bs)]
    kv.alloc_extend(rows, [ctx - 1] * bs)
    loc = kv.alloc_extend(rows, [1] * bs)
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[ctx - 1] * bs, extend_lens=[1] * bs,
                            out_cache_loc=loc, device="cuda")
    return rows, fb


def bench_jit(label: str) -> dict:
    kv = KVCache(num_layers=1, num_kv_heads=HKV, head_dim=D, max_batch_size=2, max_context=64, kv_cache_tokens=128,
                 dtype=torch.bfloat16, device="cuda")
    backend = create_backend("flashinfer", kv, [AttentionLayer(0, HQ, HKV, D)], extend_prefix_path="cascade")
    t0 = time.perf_counter()
    per_kernel = backend.warmup()
    return {"label": label, "seconds": time.perf_counter() - t0, "per_kernel": per_kernel}


def bench_decode() -> list[dict]:
    layer = AttentionLayer(0, HQ, HKV, D)
    kv = KVCache(num_layers=1, num_kv_heads=HKV, head_dim=D, max_batch_size=max(BATCHES), max_context=max(CONTEXTS),
                 kv_cache_tokens=max(BATCHES) * max(CONTEXTS), dtype=torch.bfloat16, device="cuda")
    for buf in (*kv.pool.k_buffers, *kv.pool.v_buffers):
        buf.normal_()
    rows_out = []
    for fast in (True, False):
        backend = create_backend("flashinfer", kv, [layer], fast_decode_plan=fast)
        backend.init_cuda_graph_state(max(BATCHES), max(BATCHES))
        for bs in BATCHES:
            for ctx in CONTEXTS:
                rows, fb = _decode_batch(kv, bs, ctx)
                q = torch.randn(bs, HQ, D, dtype=torch.bfloat16, device="cuda")
                k = torch.randn(bs, HKV, D, dtype=torch.bfloat16, device="cuda")
                out = torch.empty_like(q)
                fb.graph_bucket = None
                eager_plan_s = _median_host_seconds(lambda: backend.init_forward_metadata(fb))
                row = {"bs": bs, "ctx": ctx}
                if fast:
                    row["eager_us"] = triton.testing.do_bench(lambda: backend.decode_attention(q, layer, out),
                                                              return_mode="median") * 1e3
                    with forward_context(fb, backend):
                        row["forward_us"] = triton.testing.do_bench(
                            lambda: backend.forward(q, k, k, layer, fb, out), return_mode="median") * 1e3
                    row["eager_plan_us"] = eager_plan_s * 1e6
                fb.graph_bucket = bs
                backend.init_forward_metadata_out_graph(fb, in_capture=True)  # first plan of the bucket
                plan_s = _median_host_seconds(lambda: backend.init_forward_metadata_out_graph(fb))
                if fast:
                    graph_ms = triton.testing.do_bench_cudagraph(lambda: backend.decode_attention(q, layer, out),
                                                                 return_mode="median")
                    kv_bytes = 2 * bs * ctx * HKV * D * 2
                    row |= {"graph_us": graph_ms * 1e3, "kv_tbps": kv_bytes / (graph_ms * 1e-3) / 1e12,
                            "graph_fast_plan_us": plan_s * 1e6}
                    rows_out.append(row)
                else:
                    next(r for r in rows_out if r["bs"] == bs and r["ctx"] == ctx)["graph_plan_us"] = plan_s * 1e6
                for r in rows:
                    kv.free_request(r)
        backend = None  # noqa: F841 - free its buffers before the next variant
    for r in rows_out:
        r["pct_peak"] = 100 * r["kv_tbps"] / PEAK_TB_S
    return rows_out


def bench_plan_breakdown(batches: tuple[int, ...] = (1, 64, 256), ctx: int = 4096) -> list[dict]:
    """Host time (median us, synchronized) of the pieces of a graph-bucket re-plan."""
    from compile_attn.attention.flashinfer.paged_indices import PagedKV, page_csr
    from compile_attn.attention.flashinfer.wrappers import plan_decode

    layer = AttentionLayer(0, HQ, HKV, D)
    kv = KVCache(num_layers=1, num_kv_heads=HKV, head_dim=D, max_batch_size=max(batches), max_context=ctx,
                 kv_cache_tokens=max(batches) * ctx, dtype=torch.bfloat16, device="cuda")
    backend = create_backend("flashinfer", kv, [layer])
    backend.init_cuda_graph_state(max(batches), max(batches))
    graph, group, fi = backend._graph, backend.groups[0], backend._fi
    results = []
    for bs in batches:
        rows, fb = _decode_batch(kv, bs, ctx)
        fb.graph_bucket = bs
        backend.init_forward_metadata_out_graph(fb, in_capture=True)
        wrapper = graph.wrappers(bs)[0]
        csr = page_csr(fb.seq_lens_cpu, 1)
        paged = PagedKV(indptr_cpu=csr.indptr, indices=graph.indices[: csr.total_pages],
                        last_page_len_cpu=csr.last_page_len)
        us = {}
        us["empty (sync only)"] = _median_host_seconds(lambda: None, 50)
        us["page_csr (host CSR)"] = _median_host_seconds(lambda: page_csr(fb.seq_lens_cpu, 1), 50)
        us["page-id gather (in the graph when captured)"] = _median_host_seconds(
            lambda: graph.gather(kv.req_to_token, fb.req_pool_indices), 50)
        us["flashinfer plan"] = _median_host_seconds(
            lambda: plan_decode(fi, wrapper, group, paged, 1, backend.dtypes), 50)
        us["flashinfer fast_decode_plan"] = _median_host_seconds(
            lambda: plan_decode(fi, wrapper, group, paged, 1, backend.dtypes, fast=True), 50)
        for fast in (True, False):
            graph.fast_plan = fast
            us[f"out_graph (fast plan {fast})"] = _median_host_seconds(
                lambda: backend.init_forward_metadata_out_graph(fb), 50)
        graph.fast_plan = True
        results.append({"bs": bs, "ctx": ctx} | {k: v * 1e6 for k, v in us.items()})
        for r in rows:
            kv.free_request(r)
    return results


def bench_extend_paths() -> list[dict]:
    layer = AttentionLayer(0, HQ, HKV, D)
    shapes = ((4, 2048, 512), (16, 1024, 64), (8, 256, 256), (1, 4096, 1024))
    kv = KVCache(num_layers=1, num_kv_heads=HKV, head_dim=D, max_batch_size=16, max_context=5200, kv_cache_tokens=40000,
                 dtype=torch.bfloat16, device="cuda")
    backends = {p: create_backend("flashinfer", kv, [layer], extend_prefix_path=p) for p in ("paged", "cascade")}
    results = []
    for bs, prefix, ext in shapes:
        rows = [kv.alloc_request() for _ in range(bs)]
        kv.alloc_extend(rows, [prefix] * bs)
        loc = kv.alloc_extend(rows, [ext] * bs)
        fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[prefix] * bs, extend_lens=[ext] * bs,
                                out_cache_loc=loc, device="cuda")
        t = bs * ext
        q = torch.randn(t, HQ, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(t, HKV, D, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(q)
        row = {"bs": bs, "prefix": prefix, "extend": ext}
        for path, backend in backends.items():
            backend.init_forward_metadata(fb)
            with forward_context(fb, backend):
                row[f"{path}_us"] = triton.testing.do_bench(lambda: backend.forward(q, k, k, layer, fb, out),
                                                            return_mode="median") * 1e3
        results.append(row)
        for r in rows:
            kv.free_request(r)
    return results


def bench_model_step(batches: tuple[int, ...] = (1, 16, 64), ctx: int = 1024) -> list[dict]:
    """Decode step of a Llama-3.2-1B-shaped ToyDecoder (random weights) through full decode graphs."""
    from compile_attn.config import GraphConfig
    from compile_attn.graph_runner import GraphRunner
    from compile_attn.models import ToyDecoder

    cfg = toy_decoder_config()
    with torch.device("cuda"):
        model = ToyDecoder(cfg).to(dtype=torch.bfloat16).eval()
    kv = KVCache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                 max_batch_size=max(batches), max_context=ctx + 8, kv_cache_tokens=max(batches) * (ctx + 8),
                 dtype=torch.bfloat16, device="cuda")
    backend = create_backend("flashinfer", kv, model.attention_layers())
    runner = GraphRunner(model, backend, GraphConfig(mode="full", decode_batch_sizes=batches, cache_dir=None),
                         max_batch_size=max(batches), max_num_tokens=max(batches))
    runner.capture()
    results = []
    for bs in batches:
        rows, fb = _decode_batch(kv, bs, ctx)
        step_s = _median_host_seconds(lambda: runner.run(fb))
        graph = runner._graphs[runner.route(fb)]  # internal: replay alone, without padding and re-plan
        replay_ms = triton.testing.do_bench(graph.replay, return_mode="median")
        results.append({"bs": bs, "ctx": ctx, "step_ms": step_s * 1e3, "replay_ms": replay_ms,
                        "full_graph_runs": runner.stats.runs["full"]})
        for r in rows:
            kv.free_request(r)
    return results


def _table(decode: list[dict]) -> str:
    lines = [f"| bs x ctx | eager us | graph us | KV TB/s | % of {PEAK_TB_S} TB/s | forward us (with KV store) | "
             "plan us: eager / graph / graph fast |", "|---|---|---|---|---|---|---|"]
    for r in decode:
        lines.append(f"| {r['bs']} x {r['ctx']} | {r['eager_us']:.1f} | {r['graph_us']:.1f} | {r['kv_tbps']:.2f} | "
                     f"{r['pct_peak']:.0f}% | {r['forward_us']:.1f} | {r['eager_plan_us']:.0f} / "
                     f"{r.get('graph_plan_us', float('nan')):.0f} / {r['graph_fast_plan_us']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write results as JSON here")
    parser.add_argument("--only", choices=["jit", "decode", "plan", "extend", "model"], action="append",
                        help="run only these sections (repeatable); default: all")
    parser.add_argument("--jit-label", default="as found", help="what state the JIT cache is in (for the record)")
    args = parser.parse_args()
    require_cuda("bench_flashinfer_decode.py")
    sections = args.only or ["jit", "decode", "plan", "extend", "model"]
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if "jit" in sections:
        results["jit"] = bench_jit(args.jit_label)
        print(f"JIT warm-up ({args.jit_label}): {results['jit']['seconds']:.1f} s")
    if "decode" in sections:
        results["decode"] = bench_decode()
        print(_table(results["decode"]))
    if "plan" in sections:
        results["plan"] = bench_plan_breakdown()
        keys = [k for k in results["plan"][0] if k not in ("bs", "ctx")]
        print("| decode re-plan, host us (ctx 4096) | " + " | ".join(f"bs {r['bs']}" for r in results["plan"]) + " |")
        print("|---|" + "---|" * len(results["plan"]))
        for k in keys:
            print(f"| {k} | " + " | ".join(f"{r[k]:.0f}" for r in results["plan"]) + " |")
    if "extend" in sections:
        results["extend"] = bench_extend_paths()
        print("| bs x prefix + extend | paged us | cascade us |\n|---|---|---|")
        for r in results["extend"]:
            print(f"| {r['bs']} x {r['prefix']} + {r['extend']} | {r['paged_us']:.1f} | {r['cascade_us']:.1f} |")
    if "model" in sections:
        results["model"] = bench_model_step()
        print("| Llama-3.2-1B-shaped decode (full graph) | step ms (pad + re-plan + replay) | replay ms |\n|---|---|---|")
        for r in results["model"]:
            print(f"| bs {r['bs']} x ctx {r['ctx']} | {r['step_ms']:.2f} | {r['replay_ms']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
