"""Where a speculative (verify) engine step's time goes on the host, beside a plain decode step's.

``LLM.generate`` at batch ``--batch-size`` with the always-right proposer of ``bench_speculative.py`` (it replays
the greedy continuation of a plain run), then the same prompts without speculation. Each stage of ``LLM.step`` is
timed from the host (perf_counter around the call, summed over the run, divided by the steps): proposing and
scheduling, the batch built, the forward and sampling launched, the wait for the device (``InFlightStep.read``)
and writing the accepted tokens; the host's own share besides (the slot allocation, the batch built, the graph's
replay view) and the graph replays, whose time the host share leaves out. ``--trace DIR`` also writes a torch
profiler trace of a few steps of each.

    python benchmarks/profile_speculative_step.py --batch-sizes 1 --trace /tmp/spec_trace

``--tiny`` runs a tiny model on the CPU (torch_native; ``--backend triton`` with ``TRITON_INTERPRET=1`` takes the
full verify graphs' route as on a GPU, the graphs' replays interpreted): there the step less the replays is the
host's share, measured without a GPU.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_speculative import ReplayProposer  # noqa: E402

from compile_attn.batch import ForwardBatch  # noqa: E402
from compile_attn.bench import decode_step as bench  # noqa: E402
from compile_attn.engine import LLM, SamplingParams  # noqa: E402
from compile_attn.engine import llm as llm_module  # noqa: E402
from compile_attn.engine.execution.in_flight import InFlightStep  # noqa: E402


class Stages:
    """Host seconds per named stage, summed over the calls (a call inside another counts in both), and each call's
    (their median: a call the OS preempted on a busy host does not move it)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.each: dict[str, list[float]] = collections.defaultdict(list)

    def clear(self) -> None:
        for d in (self.seconds, self.calls, self.each):
            d.clear()

    def wrap(self, owner: object, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.seconds[name] += dt
                self.calls[name] += 1
                self.each[name].append(dt)

        # A class's classmethod comes back bound from getattr (wrap it as a staticmethod); a plain function of a class
        # stays a function, so that instances still pass themselves.
        bound = isinstance(owner, type) and isinstance(owner.__dict__.get(attr), (classmethod, staticmethod))
        setattr(owner, attr, staticmethod(timed) if bound else timed)

    def table(self, steps: int) -> list[tuple[str, float, int, float]]:
        """(stage, ms per step, calls, median us per call) of each stage."""
        return [(n, 1e3 * s / steps, self.calls[n], 1e6 * statistics.median(self.each[n]))
                for n, s in self.seconds.items()]


def instrument(llm: LLM, stages: Stages) -> None:
    stages.wrap(llm, "_step", "step (all)")
    stages.wrap(llm, "_launch", "launch")
    stages.wrap(llm, "_resolve", "resolve")
    stages.wrap(llm_module, "schedule_step", "launch: propose + schedule")
    if llm.speculator is not None:
        stages.wrap(llm.speculator, "propose", "launch: propose")
        stages.wrap(llm.speculator, "resolve", "resolve: accept + write")
    stages.wrap(llm_module, "forward_and_sample", "launch: forward + sample")
    stages.wrap(llm.step_runner, "run", "launch: runner.run")
    stages.wrap(llm.step_runner.runner, "run", "launch: graph runner")
    # The host's own share: the allocation, the batch, the replay view (a graph's replay is the device's share;
    # on the CPU it computes the model, so the host share is the step less the replays).
    stages.wrap(llm.kv_cache, "alloc_extend", "host: alloc_extend")
    stages.wrap(ForwardBatch, "build", "host: ForwardBatch.build")
    stages.wrap(InFlightStep, "read", "resolve: wait for the device")
    views = llm.step_runner.runner.views
    for attr in ("verify_view", "decode_view", "extend_view"):
        stages.wrap(views, attr, f"host: views.{attr}")
    runner = llm.step_runner.runner
    for graph in [*runner._graphs.values(), *runner._verify_graphs.values()]:
        stages.wrap(graph, "replay", "device: graph replay")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--backend", help="attention backend (default: triton; torch_native with --tiny)")
    ap.add_argument("--trace", help="write torch profiler traces (chrome JSON) of 8 steps of each batch size here")
    ap.add_argument("--cprofile", action="store_true", help="print a cProfile of the measured run (slows it)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (smoke run)")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    shape = bench.TINY if args.tiny else bench.LLAMA_1B
    dtype = torch.float32 if args.tiny else torch.bfloat16
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    context = args.prompt_len + args.max_new_tokens + 2 * args.k + 16
    backend = args.backend or ("torch_native" if args.tiny else "triton")
    if args.tiny and backend == "triton":  # the triton kernels' smallest head_dim (interpreted on the CPU)
        shape = dict(shape, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    base = dict(attn_backend=backend, device=device, dtype=dtype,
                max_batch_size=max(sizes), max_num_tokens=max(2048, max(sizes) * (args.k + 1)), max_context=context,
                kv_cache_tokens=max(sizes) * context + 4096, compile_options={"cache_dir": None})
    if args.tiny:  # decode graphs that take a verify step's rows (a CPU backend has no verify graphs)
        rows = sorted({1, 2, 4, *(b * (args.k + 1) for b in sizes)})
        base.update(graph_mode="full", compile=False, compile_options={"cache_dir": None, "decode_batch_sizes": rows})
    model = bench._hf_model(bench.BenchConfig(shape=dict(shape), device=device), "sdpa", dtype)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = LLM(model, speculative_config=ngram, **base)
    lookup, stages = llm.speculator.proposer, Stages()
    instrument(llm, stages)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    for bs in sizes:
        prompts = [torch.randint(0, shape["vocab_size"], (args.prompt_len,), generator=gen).tolist()
                   for _ in range(bs)]
        sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
        llm.speculator.proposer = lookup
        ref = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        known = ref
        for name in ("warm-up", "warm-up 2", "always-right proposer"):
            # replays the previous pass's own tokens: a verify step's other GEMM shapes round differently in bf16
            sequences = [p + r for p, r in zip(prompts, known)]
            llm.speculator.proposer = ReplayProposer(sequences, args.k, min(32, args.prompt_len))
            stages.clear()
            steps0, verified0 = llm.num_steps, llm.speculator.stats.verify_steps
            sync()
            t0 = time.perf_counter()
            prof = cProfile.Profile() if args.cprofile and name == "always-right proposer" else None
            if prof is not None:
                prof.enable()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            sync()
            wall = time.perf_counter() - t0
            if prof is not None:
                prof.disable()
            previous, known = known, [o.token_ids for o in outs]
        steps, verify_steps = llm.num_steps - steps0, llm.speculator.stats.verify_steps - verified0
        tokens = sum(len(o.token_ids) for o in outs)
        same = sum(o.token_ids == r for o, r in zip(outs, previous))
        print(f"\n## batch {bs}: {steps} steps ({verify_steps} verify), {tokens} tokens ({same}/{bs} requests equal "
              f"to the replayed tokens), {1e3 * wall / steps:.3f} ms per step, {tokens / wall:,.0f} tok/s")
        print("| stage | ms per step | calls | median us per call |\n|---|---|---|---|")
        table = sorted(stages.table(steps), key=lambda t: t[0])
        for stage, ms, calls, median in table:
            print(f"| {stage} | {ms:.3f} | {calls} | {median:.0f} |")
        ms = {stage: v for stage, v, _, _ in table}
        host = ms.get("step (all)", 0.0) - ms.get("device: graph replay", 0.0)
        print(f"host share (step less graph replays): {host:.3f} ms per step")
        if prof is not None:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(45)
            print(text.getvalue())
        if args.trace:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
            for p in prompts:
                llm.add_request(p, sp)
            for _ in range(4):
                llm.step()
            with profile(activities=acts) as prof:
                for _ in range(8):
                    llm.step()
            while llm.has_work():
                llm.step()
            Path(args.trace).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(args.trace) / f"verify_bs{bs}.json"))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
