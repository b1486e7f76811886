"""Host cost of a piecewise decode step (Llama-3.2-1B shape): where the CPU time of one step goes, and what one
eager attention call and its parts cost.

Piecewise decode replays one CUDA graph per piece and calls attention eagerly between them; at small batch the GPU
work per layer (~90 us at bs 1) is less than the host work, so the step is host-bound. This prints, at one batch
size: the step time with a sync per step, the host time to issue one step (no sync inside the timed region), a
cProfile of steps by self time, and the host cost per call of the attention op, the backend's decode path and the
Triton kernel wrappers it launches (each issued 2000 times with one sync at the end: host-bound, so wall / calls is
the host cost).

    python benchmarks/profile_piecewise_host.py --backend triton --batch-size 1
    python benchmarks/profile_piecewise_host.py --backend triton --batch-size 1 --mode full

With ``--mode full`` the step is one graph replay; the timeline then shows the host path before it (decode view,
out-of-graph metadata) and the replay call itself, and the graph's replay is also timed alone.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable

import torch

from compile_attn.bench import decode_step as bench


def per_call_us(fn: Callable[[], object], calls: int = 2000) -> float:
    """Median over 5 rounds of (wall of ``calls`` issues + one sync) / calls, in microseconds."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return sorted(rounds)[2]


def issue_us(fn: Callable[[], object], calls: int = 200) -> tuple[float, float]:
    """(median host time to issue one call, median wall of one call with a sync after it), microseconds."""
    issue, wall = [], []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        issue.append((t1 - t0) * 1e6)
        wall.append((t2 - t0) * 1e6)
    return sorted(issue)[calls // 2], sorted(wall)[calls // 2]


def step_timeline(step: Callable[[], object], backend: object, steps: int = 50) -> str:
    """Where the host's time to issue one step goes, from timestamps (``perf_counter_ns``, ~0.1 us each) taken at
    the entry and exit of ``GraphRunner.run``, the compiled model's ``forward``, every piece wrapper, the
    backend's ``forward_decode`` and ``init_forward_metadata_out_graph``, the runner's decode view and (full
    mode) the graph's replay: the median per step of each kind of interval, summed over the step."""
    from compile_attn.compiler.compiled_model import CompiledModel
    from compile_attn.compiler.cuda_graph import CudaGraph
    from compile_attn.compiler.piecewise import PiecewiseGraphWrapper
    from compile_attn.graph_runner.replay_view import ReplayViews
    from compile_attn.graph_runner.runner import GraphRunner

    stamps: list[tuple[str, int]] = []
    clock = time.perf_counter_ns

    def traced(cls: type, method: str, tag: str) -> Callable[[], None]:
        original = getattr(cls, method)

        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            stamps.append((tag + ">", clock()))
            try:
                return original(*args, **kwargs)
            finally:
                stamps.append((tag + "<", clock()))

        setattr(cls, method, wrapper)
        return lambda: setattr(cls, method, original)

    undo = [traced(GraphRunner, "run", "run"), traced(CompiledModel, "forward", "model"),
            traced(PiecewiseGraphWrapper, "__call__", "piece"), traced(type(backend), "forward_decode", "attn"),
            traced(ReplayViews, "decode_view", "view"),
            traced(type(backend), "init_forward_metadata_out_graph", "meta"),
            traced(CudaGraph, "replay", "graph")]
    per_step: list[dict[str, float]] = []
    try:
        for _ in range(steps):
            stamps.clear()
            torch.cuda.synchronize()
            step()
            totals: dict[str, float] = {}
            for (a, ta), (b, tb) in zip(stamps, stamps[1:]):
                key = f"{a} -> {b}"
                totals[key] = totals.get(key, 0.0) + (tb - ta) / 1e3
            per_step.append(totals)
    finally:
        for u in undo:
            u()
    keys = sorted({k for t in per_step for k in t}, key=lambda k: -sorted(t.get(k, 0) for t in per_step)[steps // 2])
    rows = ["| interval (host, one step) | count | us per step (median) |", "|---|---|---|"]
    counts = {}
    for (a, _), (b, _) in zip(stamps, stamps[1:]):
        counts[f"{a} -> {b}"] = counts.get(f"{a} -> {b}", 0) + 1
    total = 0.0
    for k in keys:
        med = sorted(t.get(k, 0.0) for t in per_step)[steps // 2]
        total += med
        rows.append(f"| `{k}` | {counts.get(k, 0)} | {med:.1f} |")
    rows.append(f"| sum of medians | | {total:.1f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--mode", default="piecewise")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from compile_attn.context import forward_context
    from compile_attn.hf import HFModelAdapter

    bs = args.batch_size
    cfg = bench.BenchConfig(batch_sizes=[bs], context=args.context, backends=[args.backend], modes=[args.mode],
                            hf_baselines=[])
    model = bench._hf_model(cfg, "sdpa", torch.bfloat16)
    adapter = HFModelAdapter(model)
    setup = bench.DecodeSetup(adapter, cfg, args.backend, torch.bfloat16)
    runner, _, _ = bench.make_runner(adapter, setup, cfg, args.mode)
    fb = setup.batch(bs)
    backend = setup.backend
    layer = adapter.attention_layers()[0]
    hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = torch.randn(bs, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lines = [f"## {args.backend} {args.mode}, bs {bs}, context {args.context}"]
    with torch.inference_mode():
        def step() -> object:
            return runner.run(fb)

        issue, wall = issue_us(step)
        lines.append(f"step: issue {issue:.0f} us on the host, {wall:.0f} us with a sync after it, "
                     f"{per_call_us(step, 200):.0f} us back to back")
        graph = runner._graphs.get(runner.route(fb))
        if args.mode == "full" and graph is not None:  # the replay alone: its host cost and its wall with a sync
            issue, wall = issue_us(graph.replay)
            lines.append(f"graph replay alone: issue {issue:.0f} us on the host, {wall:.0f} us with a sync after it, "
                         f"{per_call_us(graph.replay, 200):.0f} us back to back")
        backend.init_forward_metadata(fb)
        with forward_context(fb, backend, graph_mode="none"):
            parts: dict[str, Callable[[], object]] = {
                "torch.ops.compile_attn.attention": lambda: torch.ops.compile_attn.attention(q, k, v, out, 0),
                "backend.forward_decode": lambda: backend.forward_decode(q, k, v, layer, fb, out, True),
            }
            ops = getattr(backend, "_ops", None)
            if ops is not None and hasattr(ops, "store_kv"):
                kb, vb = setup.kv.pool.get_kv(0)
                parts["kernels.store_kv (not used by decode: fused into the split kernel)"] = (
                    lambda: ops.store_kv(kb, vb, fb.out_cache_loc, k, v))
                step_md = backend.step_metadata
                idx = step_md.indexes[None]
                sc = step_md.scratch[(hq, layer.v_head_dim)]
                # as the backend calls it: fused store, one launch (the split programs merge, semaphores)
                parts["kernels.decode_attention_fwd (fused store, one launch)"] = lambda: ops.decode_attention_fwd(
                    q, kb, vb, out, idx.kv_indptr, idx.kv_indices, idx.num_kv_splits, backend.max_kv_splits,
                    sc.attn_logits, sc.attn_lse, layer.scaling, 0.0, k_new=k, v_new=v, new_loc=fb.out_cache_loc,
                    semaphores=sc.semaphores)
            parts["torch add_ (one aten launch, reference)"] = lambda: out.add_(1.0)
            for name, fn in parts.items():
                lines.append(f"{name}: {per_call_us(fn):.1f} us per call")
            if getattr(backend, "graph_buffers", None) is not None and hasattr(backend, "bound_decode_launches"):
                # the same batch as a graph-bucket view: metadata in the static buffers, the same q/k/v/out
                # every call, so after the first call the layer relaunches through its DecodePlan
                bound_fb = setup.batch(bs)
                bound_fb.graph_bucket = bs
                backend.init_forward_metadata(bound_fb)
                before = backend.bound_decode_launches
                cost = per_call_us(lambda: backend.forward_decode(q, k, v, layer, bound_fb, out, True))
                lines.append(f"backend.forward_decode, graph-bound (DecodePlan, {backend.bound_decode_launches - before}"
                             f" bound launches): {cost:.1f} us per call")
            attention_profile = bench.host_profile(parts["torch.ops.compile_attn.attention"], calls=200, top=30)
    step_profile = bench.host_profile(step, calls=30, top=30)
    with torch.inference_mode():
        timeline = step_timeline(step, backend)
    print("\n".join(lines))
    print(f"\n### Host timeline of a step\n{timeline}")
    print(f"\n### cProfile of 30 steps (by self time)\n```\n{step_profile}\n```")
    print(f"\n### cProfile of 200 attention op calls (by self time)\n```\n{attention_profile}\n```")


if __name__ == "__main__":
    main()
