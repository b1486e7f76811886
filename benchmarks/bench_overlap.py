"""How close is a steady decode step inside the engine to the device time of that step, with and without overlap?

For each batch size B: B requests decode (prompt 128 random ids, ignore EOS); once every request decodes, the wall
time of ``LLM.step`` is averaged over ``--steps`` steps, with ``overlap`` on and off (the same LLM, the loop policy
switched). Beside it, the device time of the same step issued back to back with no host waits, measured halfway
through the overlap run: the decode graph's replay of bucket B with the static buffers as the engine's last step left
them (the same requests, contexts and KV slots), and the LM head plus argmax on B rows. One JSON line per batch size
and a markdown table. ``--trace-dir`` also records a torch.profiler trace of a few steady overlap steps per batch
size (Chrome trace JSON; ``benchmarks/gpu_trace_summary.py`` lists where each step's device time goes).

    python benchmarks/bench_overlap.py --backend triton --batch-sizes 1,64,256 --out overlap.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from compile_attn.bench import decode_step as bench
from compile_attn.batch import ForwardBatch
from compile_attn.engine import LLM, SamplingParams


def events_ms(fn, iters: int = 50, warmup: int = 5) -> float:
    """Milliseconds per call of ``fn`` issued ``iters`` times back to back (device-bound when the host is ahead)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def engine_step_ms(llm: LLM, bs: int, steps: int, overlap: bool, midway=None, after=None) -> float:
    """Median over 5 windows of the mean wall time of ``steps // 5`` steady decode steps at batch ``bs``;
    ``midway()`` runs (untimed, the device idle) after the second window, ``after()`` after the last."""
    llm.overlap = overlap
    g = torch.Generator().manual_seed(bs)
    reqs = [llm.add_request(torch.randint(0, 10000, (128,), generator=g).tolist(),
                            SamplingParams(max_tokens=steps + 64, ignore_eos=True)) for _ in range(bs)]
    while any(r.num_cached < len(r.prompt_ids) for r in reqs) or llm.steps_by_mode.total() == 0:
        llm.step()
    for _ in range(8):
        llm.step()
    torch.cuda.synchronize()
    windows = []
    per = max(1, steps // 5)
    for w in range(5):
        if w == 2 and midway is not None:
            torch.cuda.synchronize()
            midway()
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(per):
            llm.step()
        windows.append((time.perf_counter() - t0) * 1e3 / per)
    if after is not None:
        after()
    for r in reqs:
        llm.abort_request(r)
    while llm.has_work():
        llm.step()
    torch.cuda.synchronize()
    return statistics.median(windows)


def device_ms(llm: LLM, bs: int) -> tuple[float | None, float]:
    """(graph replay of the decode bucket for ``bs``, LM head + argmax on ``bs`` rows) in ms, back to back. The
    replay runs on the static buffers as they are: call it while the engine's steady batch of ``bs`` left them
    (replaying that step rewrites the same KV slots with the same values)."""
    runner = llm.step_runner.runner
    fb = ForwardBatch.build_scratch([128] * bs, [1] * bs, llm.device)
    route = runner.route(fb)
    graph = getattr(runner, "_graphs", {}).get(route) if route is not None else None
    with torch.inference_mode():
        replay = events_ms(graph.replay) if graph is not None else None
        hidden = torch.randn(bs, llm.model.config.hidden_size, device=llm.device, dtype=llm.dtype)
        head = events_ms(lambda: llm.step_runner.compute_logits(hidden).argmax(dim=-1))
    return replay, head


def trace_steps(llm: LLM, steps: int, path: str) -> None:
    """A torch.profiler trace (CPU and CUDA activity) of ``steps`` engine steps, written as Chrome trace JSON."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="triton")
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default=None)
    p.add_argument("--trace-dir", default=None, help="write decode_bs<B>.json: a profiler trace of steady steps")
    p.add_argument("--trace-steps", type=int, default=20)
    args = p.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**bench.LLAMA_1B)).to(torch.bfloat16).eval()
    llm = LLM(model, attn_backend=args.backend, max_batch_size=max(sizes), max_num_tokens=8192,
              kv_cache_tokens=max(sizes) * 1024, max_context=1024)
    rows = []
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    for bs in sizes:
        stale, _ = device_ms(llm, bs)  # on whatever the buffers held before (capture, an earlier batch size)
        serial = engine_step_ms(llm, bs, args.steps, overlap=False)
        measured: dict = {}

        def midway(bs: int = bs) -> None:
            measured["replay"], measured["head"] = device_ms(llm, bs)

        def after(bs: int = bs) -> None:
            if args.trace_dir:
                trace_steps(llm, args.trace_steps, os.path.join(args.trace_dir, f"decode_bs{bs}.json"))

        overlap = engine_step_ms(llm, bs, args.steps, overlap=True, midway=midway, after=after)
        replay, head = measured["replay"], measured["head"]
        row = dict(batch_size=bs, replay_ms=replay, head_argmax_ms=head, serial_ms=serial, overlap_ms=overlap,
                   replay_on_earlier_buffers_ms=stale)
        device = (replay or 0) + head
        row.update(device_ms=device, overlap_over_device=row["overlap_ms"] / device,
                   serial_over_device=row["serial_ms"] / device)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("| bs | graph replay ms | (on earlier buffers) | head+argmax ms | step, serial ms | step, overlap ms | "
          "overlap / device |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        stale = r["replay_on_earlier_buffers_ms"]
        print(f"| {r['batch_size']} | {r['replay_ms']:.3f} | {'-' if stale is None else f'{stale:.3f}'} | "
              f"{r['head_argmax_ms']:.3f} | {r['serial_ms']:.3f} | {r['overlap_ms']:.3f} | "
              f"{r['overlap_over_device']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(backend=args.backend, device=torch.cuda.get_device_name(), torch=torch.__version__,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
