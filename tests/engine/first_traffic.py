"""Helpers for first-traffic tests: a workload that reaches every step path of an engine, and a recorder of what
gets compiled, JIT-built or autotuned while it runs (Dynamo graphs, Triton JIT builds, Inductor kernel builds)."""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from compile_attn.compiler import compile_counters
from compile_attn.engine import LLM, SamplingParams


@dataclass
class Builds:
    """What was built inside ``record_builds()``: each list holds one name per build."""

    dynamo: dict[str, int] = field(default_factory=dict)  # changes of torch._dynamo's stats counters
    compile_attn: dict[str, int] = field(default_factory=dict)  # changes of compile_counters (compiles, captures)
    triton_jit: list[str] = field(default_factory=list)  # Triton JIT compiles (a kernel's new specialisation)
    inductor: list[str] = field(default_factory=list)  # Inductor kernels precompiled or autotuned

    def nothing(self) -> bool:
        return not (self.dynamo or self.compile_attn or self.triton_jit or self.inductor)


_QUIET = ("graph_replays", "static_piece_calls", "split_calls_direct", "linears_as_reductions")


@contextlib.contextmanager
def record_builds() -> Iterator[Builds]:
    """Record builds in the block. Triton's JIT cache hook sees every kernel specialisation our kernels build
    (it fires before a compile, whether Triton's disk cache then holds the binary or not); Inductor's kernels
    are built by ``CachingAutotuner.precompile`` and tuned by ``autotune_to_one_config``."""
    from torch._dynamo.utils import counters
    from torch._inductor.runtime import triton_heuristics

    builds = Builds()
    dynamo_before = dict(counters["stats"])
    compile_before = compile_counters.snapshot()

    def jit_hook(**info):  # noqa: ANN003, ANN202 - keyword arguments differ between Triton versions
        builds.triton_jit.append(str(info.get("repr", info.get("fn", "?"))))
        return False  # go on and compile

    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    holder = runtime if runtime is not None and hasattr(runtime, "jit_cache_hook") else None
    if holder is None:
        from triton.runtime.jit import JITFunction as holder  # Triton before knobs
    previous_hook = holder.jit_cache_hook if runtime is not None else holder.cache_hook
    autotuner = triton_heuristics.CachingAutotuner
    originals = {name: getattr(autotuner, name) for name in ("precompile", "autotune_to_one_config")}

    def observed(name):  # noqa: ANN001, ANN202
        def call(self, *args, **kwargs):  # noqa: ANN001, ANN202
            builds.inductor.append(f"{name}:{getattr(self.fn, '__name__', '?')}")
            return originals[name](self, *args, **kwargs)
        return call

    try:
        if runtime is not None:
            holder.jit_cache_hook = jit_hook
        else:
            holder.cache_hook = jit_hook
        for name in originals:
            setattr(autotuner, name, observed(name))
        yield builds
    finally:
        if runtime is not None:
            holder.jit_cache_hook = previous_hook
        else:
            holder.cache_hook = previous_hook
        for name, fn in originals.items():
            setattr(autotuner, name, fn)
        builds.dynamo = {k: v - dynamo_before.get(k, 0) for k, v in counters["stats"].items()
                         if v != dynamo_before.get(k, 0)}
        builds.compile_attn = {k: v for k, v in compile_counters.delta(compile_before).items() if k not in _QUIET}


@dataclass
class Traffic:
    prompts: list[list[int]]
    params: list[SamplingParams]


def every_path_traffic(vocab: int, longest_prompt: int, num_requests: int, seed: int = 0) -> Traffic:
    """Two long prompts (``longest_prompt`` tokens and about half of it: chunked prefills, steps over the largest
    token bucket), then short ones (1 to 12 tokens) with longer outputs, greedy and sampled: with more requests
    than a batch holds this gives prefills, mixed steps and, once the queue is empty, decode batches of every size
    up to the batch limit."""
    rng = random.Random(seed)
    lengths = [longest_prompt, longest_prompt // 2 + 1, 1, 2] + [rng.randint(1, 12) for _ in range(num_requests - 4)]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    params = [SamplingParams(max_new_tokens=rng.randint(2, 4) if i < 2 else rng.randint(12, 24),
                             temperature=0.0 if i % 3 else 0.7, seed=i, ignore_eos=True) for i in range(num_requests)]
    return Traffic(prompts, params)


@dataclass
class StepLog:
    """Shapes of the steps an engine ran: (mode name, requests, tokens) per step."""

    steps: list[tuple[str, int, int]] = field(default_factory=list)

    def modes(self) -> Counter:
        return Counter(m for m, _, _ in self.steps)


@contextlib.contextmanager
def log_steps(llm: LLM) -> Iterator[StepLog]:
    """Record the shape of every step the engine runs in the block (the step runner is called as usual)."""
    log = StepLog()
    runner = llm.step_runner
    real = runner.run

    def run(fb, keep, *feed):  # noqa: ANN001, ANN202
        log.steps.append((fb.forward_mode.name, fb.batch_size, fb.num_tokens))
        return real(fb, keep, *feed)

    runner.run = run
    try:
        yield log
    finally:
        del runner.run


def assert_every_path_taken(llm: LLM, log: StepLog) -> None:
    """The workload reached decode, extend and mixed steps, an extend over the largest token bucket and a decode
    batch over the largest decode bucket (so the eager paths ran)."""
    runner = llm.step_runner.runner
    assert {"DECODE", "EXTEND", "MIXED"} <= set(log.modes()), log.modes()
    assert any(m != "DECODE" and t > runner.extend_buckets[-1] for m, _, t in log.steps), log.steps
    assert any(m == "DECODE" and b > runner.decode_buckets[-1] for m, b, _ in log.steps), log.steps


def generate_recorded(llm: LLM, traffic: Traffic) -> tuple[list, Builds, StepLog]:
    with log_steps(llm) as log, record_builds() as builds:
        outs = llm.generate(traffic.prompts, traffic.params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return outs, builds, log
