"""Throughput benchmark: a named workload (``compile_attn.bench.workloads``) through one ``compile_attn.LLM``, run
``rounds`` times (the first right after start-up), next to HF transformers' continuous batching on the same
workload. Behind ``compile-attn throughput``; results print as a markdown table and JSON.

Each round queues every request with ``LLM.add_request`` (a multi-turn workload queues each conversation's next
turn when the turn before finishes) and calls ``LLM.step`` until the scheduler is empty, timing each step (a step
ends with its one host sync) under its ForwardMode. Each round starts with an empty prefix cache and reports its
hit rate; the prefix-cache workloads run their rounds again with the cache off, on the same engine. GPU busy fraction comes from the
profiler's kernel intervals over short windows of steps in one more round after the timed ones, since a
profiler session slows later work in the same process.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, replace

import torch

from compile_attn.bench import decode_step as bench
from compile_attn.bench import workloads as bench_workloads
from compile_attn.bench.workloads import Workload
from compile_attn.compiler.triton_builds import triton_builds

logger = logging.getLogger(__name__)


@dataclass
class ThroughputConfig:
    workload: str = "nanovllm"
    num_seqs: int | None = None  # None: the workload's own sizes
    request_rate: float | None = None  # arrivals: requests per second (None: the workload's)
    prompt_len: int | None = None  # nanovllm: the longest prompt
    output_len: int | None = None  # nanovllm: the longest output
    temperature: float | None = None  # None: the workload's own
    model: str | None = None  # a local HF directory; None: random weights of ``shape``
    shape: dict = field(default_factory=lambda: dict(bench.LLAMA_1B))
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    backend: str = "auto"
    graph_mode: str = "full_and_piecewise"
    compile: bool = True
    overlap: bool = True  # the engine keeps one step in flight
    prefix_cache: bool = True  # the prefix-cache workloads also run with it off unless this is False
    cascade_decode: bool | None = None  # EngineConfig.cascade_decode (None: COMPILE_ATTN_CASCADE_DECODE)
    speculative_config: str | dict | None = None  # EngineConfig.speculative_config (None: off)
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype: "auto", "fp8_e4m3", "fp8_e5m2"
    kv_scales_path: str | None = None  # EngineConfig.kv_scales_path (fp8 only)
    tensor_parallel_size: int = 1  # EngineConfig.tensor_parallel_size
    disable_custom_all_reduce: bool = False  # EngineConfig.disable_custom_all_reduce
    dtype: str = "auto"  # EngineConfig.dtype: "auto" is bfloat16 on CUDA, float32 on the CPU
    seed: int | None = None  # EngineConfig.seed (the workloads' requests bring none)
    max_batch_size: int = 256
    max_num_tokens: int = 8192
    kv_cache_tokens: int | None = None  # None: sized from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    page_size: int = 1
    max_context: int | None = None  # None: the workload's longest request
    rounds: int = 2
    profile_steps: int = 32  # steps per profiled window (CUDA only); 0: no profile
    hf: bool = True
    hf_rounds: int | None = None  # None: ``rounds``
    hf_max_memory_percent: float | None = 0.8

    def llm_options(self, workload: Workload, dtype: torch.dtype) -> dict:
        """The ``LLM`` keywords of this configuration for ``workload`` (whose longest request is the default
        ``max_context``)."""
        return dict(attn_backend=self.backend, graph_mode=self.graph_mode, compile=self.compile,
                    max_batch_size=self.max_batch_size, max_num_tokens=self.max_num_tokens,
                    kv_cache_tokens=self.kv_cache_tokens, gpu_memory_utilization=self.gpu_memory_utilization,
                    max_context=self.max_context or workload.longest, page_size=self.page_size, device=self.device,
                    dtype=dtype, overlap=self.overlap, enable_prefix_cache=self.prefix_cache,
                    cascade_decode=self.cascade_decode, speculative_config=self.speculative_config,
                    kv_cache_dtype=self.kv_cache_dtype, kv_scales_path=self.kv_scales_path,
                    tensor_parallel_size=self.tensor_parallel_size, seed=self.seed,
                    disable_custom_all_reduce=self.disable_custom_all_reduce)


def run(cfg: ThroughputConfig) -> dict:
    """Start the engine, run the workload ``cfg.rounds`` times, profile, then HF's rounds: one result dict."""
    from compile_attn.engine.requests.config import check_dtype

    dtype = check_dtype(cfg.dtype, torch.device(cfg.device))
    workload = make_workload(cfg)
    result: dict = dict(config=asdict(cfg), workload=workload.summary(), dtype=str(dtype).removeprefix("torch."),
                        random_weights=cfg.model is None)
    model, result["model_build_s"] = cfg.model, None  # a directory loads inside LLM(...), in its start-up
    if cfg.model is None:
        start = time.perf_counter()
        model = _random_model(cfg, dtype)
        _sync(cfg.device)
        result["model_build_s"] = time.perf_counter() - start
    engine, busy = _run_engine(model, workload, cfg, dtype)
    result["engine"] = engine | {"gpu_busy": busy}
    model = None  # the engine's adapter changed the model's attention: HF gets a fresh one
    _release(cfg.device)
    if cfg.hf and (workload.follow_ups or workload.arrival_s):
        result["hf"] = {"skipped": "generate_batch takes every prompt at once; a multi-turn prompt needs the answer "
                                   "before it, and timed arrivals come one by one"}
    elif cfg.hf:
        from compile_attn.bench import hf_batch as bench_hf_batch

        # what the engine left behind on the device (HF's KV cache takes its share of what is free)
        leftover = torch.cuda.memory_allocated() / 2**20 if cfg.device == "cuda" else None
        hf_model = _random_model(cfg, dtype) if cfg.model is None else _hf_from_dir(cfg, dtype)
        result["hf"] = bench_hf_batch.run(hf_model, workload, rounds=cfg.hf_rounds or cfg.rounds,
                                          max_memory_percent=cfg.hf_max_memory_percent) | {
            "allocated_mib_at_start": leftover}
        hf_model = None  # noqa: F841
        _release(cfg.device)
    return result


def make_workload(cfg: ThroughputConfig) -> Workload:
    vocab = cfg.shape["vocab_size"] if cfg.model is None else _dir_vocab_size(cfg.model)
    workload = bench_workloads.build(cfg.workload, vocab, num_seqs=cfg.num_seqs, prompt_len=cfg.prompt_len,
                                     output_len=cfg.output_len, request_rate=cfg.request_rate)
    return workload if cfg.temperature is None else replace(workload, temperature=cfg.temperature)


def _run_engine(model: object, workload: Workload, cfg: ThroughputConfig, dtype: torch.dtype) -> tuple[dict, list]:
    from compile_attn.engine import LLM

    _sync(cfg.device)
    triton_builds.install()
    start = time.perf_counter()
    llm = LLM(model, **cfg.llm_options(workload, dtype))
    _sync(cfg.device)
    engine = dict(system=f"compile_attn {llm.backend.name} {llm.step_runner.graph_mode.value}"
                         + ("" if cfg.overlap else " no-overlap"), overlap=cfg.overlap,
                  backend=llm.backend.name, graph_mode=llm.step_runner.graph_mode.value,
                  startup_s=time.perf_counter() - start,
                  kv_cache_tokens=llm.kv_cache.allocator.num_pages * llm.kv_cache.page_size,
                  kv_mib=llm.kv_cache.pool.bytes / 2**20,
                  kv_cache_dtype=str(llm.kv_cache.pool.dtype).removeprefix("torch."), rounds=[])
    for _ in range(cfg.rounds):
        built = triton_builds.snapshot()
        engine["rounds"].append(engine_round(llm, workload))
        engine["rounds"][-1]["triton_builds"] = triton_builds.since(built)  # kernels the warm-up did not build
        engine["rounds"][-1]["triton_specialisations"] = triton_builds.specialisations_since(built)
        logger.info("round %d: %s", len(engine["rounds"]), engine["rounds"][-1])
    if cfg.prefix_cache and workload.name in bench_workloads.PREFIX_WORKLOADS:  # the same rounds, cache off
        llm.kv_cache.enable_prefix_cache(False)
        for _ in range(cfg.rounds):
            engine["rounds"].append(engine_round(llm, workload))
            logger.info("round %d (prefix cache off): %s", len(engine["rounds"]), engine["rounds"][-1])
        llm.kv_cache.enable_prefix_cache(True)
    if llm.speculator is not None:  # drafts proposed / accepted over every round
        engine["speculative"] = dict(config=llm.speculator.config.to_dict(), **llm.speculator.stats.as_dict())
    busy: list | dict = []
    if cfg.device == "cuda" and cfg.profile_steps > 0:
        try:
            busy = gpu_busy(llm, workload, cfg.profile_steps, engine["rounds"][-1]["steps"])
        except Exception as exc:  # keep the timed rounds
            logger.exception("the GPU-busy profile failed")
            busy = {"failed": f"{type(exc).__name__}: {exc}"}
    llm.shutdown()  # tensor parallelism: stop the workers before HF's rounds
    return engine, busy


def _sampling_params(workload: Workload) -> list:
    from compile_attn.engine import SamplingParams

    return [SamplingParams(max_new_tokens=n, temperature=workload.temperature, ignore_eos=True)
            for n in workload.output_lens]


def _step(llm, finished: list | None = None) -> str:
    """One ``llm.step()`` (its finished requests appended to ``finished``); the ForwardMode it ran, by name ("idle"
    when nothing was scheduled)."""
    before = dict(llm.steps_by_mode)
    done = llm.step()
    if finished is not None:
        finished += done
    return next((m.name.lower() for m, n in llm.steps_by_mode.items() if n != before.get(m, 0)), "idle")


def engine_round(llm, workload: Workload) -> dict:
    """The whole workload through ``llm``: wall time, tok/s, steps and seconds per step kind, and the prefix cache's
    hit rate (tokens found cached over tokens of the requests that looked) and prompt tokens it saved. With overlap a
    ``step()`` call launches one step and waits for the one before, so its time is counted for the kind it launched."""
    params = _sampling_params(workload)
    preemptions = llm.scheduler.num_preemptions
    cache = _empty_prefix_cache(llm)
    looked, hits = (cache.num_lookup_tokens, cache.num_hit_tokens) if cache is not None else (0, 0)
    _sync(llm.device.type)
    start = time.perf_counter()
    arriving = deque(enumerate(workload.arrival_s))  # timed arrivals (empty: every request now)
    requests = [] if arriving else [llm.add_request(p, sp) for p, sp in zip(workload.prompts, params)]
    turn = {id(r): (i, 1) for i, r in enumerate(requests)}  # request -> (conversation, turn)
    steps: Counter[str] = Counter()
    seconds: Counter[str] = Counter()
    last = "idle"
    finished: list = []
    while arriving or llm.has_work():
        now = time.perf_counter() - start
        while arriving and arriving[0][1] <= now:
            i, _ = arriving.popleft()
            requests.append(llm.add_request(workload.prompts[i], params[i]))
            turn[id(requests[-1])] = (i, 1)
        if not llm.has_work():  # nothing to run until the next arrival
            time.sleep(max(0.0, arriving[0][1] - now))
            continue
        t0 = time.perf_counter()
        kind = _step(llm, finished)
        for r in finished:  # a multi-turn conversation's next prompt: this one, its answer, the user's new tokens
            i, k = turn[id(r)]
            if k < workload.turns(i):
                nxt = llm.add_request(list(r.token_ids) + workload.follow_ups[i][k - 1], params[i])
                turn[id(nxt)] = (i, k + 1)
                requests.append(nxt)
        finished.clear()
        if kind == "idle":  # with overlap, the last call only reads the last step's tokens: that step's time
            seconds[last] += time.perf_counter() - t0
            continue
        seconds[kind] += time.perf_counter() - t0
        steps[kind] += 1
        last = kind
    _sync(llm.device.type)
    wall = time.perf_counter() - start
    generated = sum(r.num_output for r in requests)
    if generated != workload.output_tokens:
        logger.warning("the engine generated %d tokens, the workload asks for %d", generated, workload.output_tokens)
    return dict(wall_s=wall, output_tokens=generated, output_tok_s=generated / wall,
                total_tok_s=(workload.prompt_tokens + generated) / wall, steps=sum(steps.values()),
                steps_by_kind=dict(steps), seconds_by_kind=dict(seconds),
                ms_per_step_by_kind={k: 1e3 * seconds[k] / steps[k] for k in steps},
                preemptions=llm.scheduler.num_preemptions - preemptions, prefix_cache=cache is not None,
                prefix_hit_rate=(cache.num_hit_tokens - hits) / max(1, cache.num_lookup_tokens - looked)
                if cache is not None else 0.0,
                prefill_tokens_saved=cache.num_hit_tokens - hits if cache is not None else 0)


def _empty_prefix_cache(llm):
    """The engine's prefix cache emptied (None when off): each round runs on its own, nothing cached by the one
    before (a repeated workload would otherwise skip its prefills)."""
    cache = llm.kv_cache.prefix_cache
    if cache is not None:
        cache.clear()
    return cache


def gpu_busy(llm, workload: Workload, window: int, round_steps: int) -> list[dict]:
    """GPU busy fraction (time at least one kernel or copy runs, over wall time) in two windows of ``window``
    steps of a fresh round: its start (prefills) and its middle. The round is left unfinished: the engine is
    discarded after it."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    starts = sorted({0, round_steps // 2} if round_steps // 2 >= window else {0})
    _empty_prefix_cache(llm)
    for p, sp in zip(workload.prompts, _sampling_params(workload)):
        llm.add_request(p, sp)
    done, windows = 0, []
    for first in starts:
        while done < first and llm.has_work():
            _step(llm)
            done += 1
        if not llm.has_work():
            break
        kinds: Counter[str] = Counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            while done < first + window and llm.has_work():
                kinds[_step(llm)] += 1
                done += 1
            torch.cuda.synchronize()
            wall_us = (time.perf_counter() - t0) * 1e6
        busy = bench.busy_us([(e.time_range.start, e.time_range.end) for e in prof.events()
                              if e.device_type == DeviceType.CUDA and e.device_time > 0])
        windows.append(dict(first_step=first, steps=done - first, steps_by_kind=dict(kinds),
                            wall_ms=wall_us / 1e3, busy_ms=busy / 1e3, busy_fraction=busy / wall_us))
    return windows


def _random_model(cfg: ThroughputConfig, dtype: torch.dtype) -> torch.nn.Module:
    return bench._hf_model(bench.BenchConfig(shape=cfg.shape, device=cfg.device), "sdpa", dtype)


def _hf_from_dir(cfg: ThroughputConfig, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype).to(cfg.device).eval()


def _dir_vocab_size(path: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).get_text_config().vocab_size


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _release(device: str) -> None:
    torch._dynamo.reset()  # compiled code holds the model and its graphs
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def to_markdown(result: dict) -> str:
    """The result as a header, one table row per system and round, and the start-up and GPU-busy lines."""
    w, cfg = result["workload"], result["config"]
    model = cfg["model"] or f"random weights ({result['dtype']}) of the shape {_shape_name(cfg['shape'])}"
    engine = result["engine"]
    lines = [
        f"workload {w['name']}: {w['num_seqs']} sequences, {w['prompt_tokens']:,} prompt + {w['output_tokens']:,} "
        f"output tokens, temperature {w['temperature']}, EOS ignored",
        f"model: {model}, {cfg['device']}; engine: {engine['backend']}, {engine['graph_mode']}, max batch "
        f"{cfg['max_batch_size']}, max tokens per step {cfg['max_num_tokens']}, KV cache "
        f"{engine['kv_cache_tokens']:,} tokens ({engine['kv_mib']:.0f} MiB, {engine.get('kv_cache_dtype', '?')}), "
        f"page size {cfg['page_size']}",
        "",
        "| system | round | wall s | output tok/s | total tok/s | steps | decode: steps, ms each | "
        "extend: steps, ms each | mixed: steps, ms each | preemptions | prefix cache: hit rate, tokens saved |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    on_rounds = sum(r.get("prefix_cache", True) for r in engine["rounds"])
    for i, r in enumerate(engine["rounds"]):
        kinds = [f"{r['steps_by_kind'].get(k, 0)}, {r['ms_per_step_by_kind'].get(k, 0.0):.1f}"
                 for k in ("decode", "extend", "mixed")]
        on = r.get("prefix_cache", True)
        system = engine["system"] + ("" if on else ", prefix cache off")
        cached = f"{100 * r['prefix_hit_rate']:.1f}%, {r['prefill_tokens_saved']:,}" if on else "off"
        lines.append(f"| {system} | {_round_name(i if on or not on_rounds else i - on_rounds)} | {r['wall_s']:.2f} | "
                     f"{r['output_tok_s']:,.0f} | {r['total_tok_s']:,.0f} | {r['steps']} | {' | '.join(kinds)} | "
                     f"{r['preemptions']} | {cached} |")
    hf = result.get("hf")
    if hf is not None and "skipped" in hf:
        lines.append(f"| HF generate_batch | - | skipped: {hf['skipped']} | | | | | | | | |")
    elif hf is not None:
        for i, r in enumerate(hf["rounds"]):
            lines.append(f"| HF generate_batch ({hf['attn_implementation']}) | {_round_name(i)} | {r['wall_s']:.2f} | "
                         f"{r['output_tok_s']:,.0f} | {r['total_tok_s']:,.0f} | - | - | - | - | - | - |")
    starts = [f"LLM(...) {engine['startup_s']:.1f} s"]
    if result["model_build_s"] is not None:
        starts.insert(0, f"random model built on {cfg['device']} in {result['model_build_s']:.1f} s (before LLM(...))")
    if hf is not None and "startup_s" in hf:
        starts.append(f"HF continuous-batching manager {hf['startup_s']:.1f} s")
    if hf is not None and hf.get("allocated_mib_at_start"):
        starts.append(f"{hf['allocated_mib_at_start']:.0f} MiB of the engine still allocated when HF started")
    lines += ["", "start-up: " + "; ".join(starts)]
    for i, r in enumerate(engine["rounds"]):
        if r.get("triton_builds"):  # a kernel specialisation first met on traffic: a compile inside a step
            built = ", ".join(f"{name} x {n}" for name, n in r["triton_builds"].items())
            lines.append(f"Triton kernels built during round {_round_name(i)}: {built}")
            lines += [f"  {spec}" for spec in r.get("triton_specialisations", [])]
    if isinstance(engine["gpu_busy"], dict):
        lines.append(f"GPU busy: the profile failed ({engine['gpu_busy']['failed']})")
    elif engine["gpu_busy"]:
        windows = [f"steps {b['first_step']}-{b['first_step'] + b['steps'] - 1} "
                   f"({', '.join(f'{n} {k}' for k, n in sorted(b['steps_by_kind'].items()))}): "
                   f"{100 * b['busy_fraction']:.0f}%" for b in engine["gpu_busy"]]
        lines.append("GPU busy (kernels and copies over wall time, profiled in a round after the timed ones): "
                     + "; ".join(windows))
    return "\n".join(lines)


def _round_name(i: int) -> str:
    return "1 (first)" if i == 0 else str(i + 1)


def _shape_name(shape: dict) -> str:
    if shape == bench.LLAMA_1B:
        return "Llama-3.2-1B"
    return f"Llama, hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, vocab {shape['vocab_size']}"
