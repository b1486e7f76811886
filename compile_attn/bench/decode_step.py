"""Decode-step benchmark: compile_attn per graph mode and backend, next to HF transformers eager and HF
static cache + ``torch.compile(mode="reduce-overhead")`` in the same process, and the bandwidth floor.

One decode step = every request adds one token to ``context`` cached tokens. Times are medians of CUDA
events (wall clock on CPU) after warm-up. The floor is the bytes a step must read (weights + KV) over
``bandwidth`` bytes/s. Behind ``compile-attn bench``; results print as a markdown table and JSON.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

logger = logging.getLogger(__name__)

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                max_position_embeddings=8192)
# Llama-3.1-8B: the tensor-parallel benchmarks' shape
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=512)


@dataclass
class BenchConfig:
    shape: dict = field(default_factory=lambda: dict(LLAMA_1B))
    batch_sizes: Sequence[int] = (1, 16, 64, 256)
    context: int = 512
    backends: Sequence[str] = ("auto",)
    modes: Sequence[str] = ("none", "piecewise", "full")
    hf_baselines: Sequence[str] = ("eager", "static_compiled")
    iters: int = 20
    warmup: int = 3
    bandwidth: float = 3.0e12
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    profile: bool = True  # kernel time per step from the profiler (CUDA only)
    fuse_linears: bool = True  # q/k/v and gate/up as one GEMM each (compiled modes)
    inductor_config: dict = field(default_factory=dict)  # Inductor config patches for the compiled pieces
    compile_sizes: Sequence[int] | None = None  # GraphConfig.compile_sizes (None: the device decides)
    static_inductor_config: dict = field(default_factory=dict)  # patches for the static compiles only
    wall_clock: bool = False  # time with the host's clock and a synchronize around each call, not CUDA events

    def compile_options(self) -> dict:
        """The GraphConfig fields this benchmark varies, for every model it compiles (decode rows, engine starts)."""
        return {"fuse_linears": self.fuse_linears, "inductor_config": dict(self.inductor_config),
                "compile_sizes": None if self.compile_sizes is None else tuple(self.compile_sizes),
                "static_inductor_config": dict(self.static_inductor_config)}


@dataclass
class Row:
    system: str
    batch_size: int
    ms: float
    floor_ms: float
    kernel_ms: float | None = None  # GPU busy time per step (profiler); ms - kernel_ms = gaps + host
    top_kernels: list[str] = field(default_factory=list)
    graph_mib: float | None = None
    replay_ms: float | None = None  # full mode: the decode graph's replay alone (ms - replay_ms = host work)

    @property
    def floor_ratio(self) -> float:
        return self.ms / self.floor_ms


def _timed(fn: Callable[[], object], cfg: BenchConfig) -> float:
    """Median milliseconds of ``fn`` over ``cfg.iters`` runs after ``cfg.warmup``: CUDA events around each call on
    CUDA (device time), else wall clock; ``cfg.wall_clock`` times CUDA calls by wall clock too, with a synchronize
    before and after each (the host's time until ``fn`` and its device work are done)."""
    for _ in range(cfg.warmup):
        fn()
    times = []
    cuda = cfg.device == "cuda"
    for _ in range(cfg.iters):
        if cuda and not cfg.wall_clock:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _hf_model(cfg: BenchConfig, attn: str, dtype: torch.dtype):
    """The benchmark's HF Llama with random weights, initialised directly on ``cfg.device`` (fast on a GPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(cfg.device):
        model = LlamaForCausalLM(LlamaConfig(**cfg.shape)).to(dtype).eval()
    if attn != "sdpa":
        model.set_attn_implementation(attn)
    return model


def floor_ms(model: torch.nn.Module, cfg: BenchConfig, bs: int, dtype: torch.dtype) -> float:
    """Bytes a decode step must read (every weight once, every cached K and V once) over the bandwidth."""
    weights = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    s = cfg.shape
    kv = bs * cfg.context * s["num_hidden_layers"] * 2 * s["num_key_value_heads"] * s["head_dim"] * dtype.itemsize
    return (weights + kv) / cfg.bandwidth * 1e3


def busy_us(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: the time at least one of them runs. Kernels that overlap
    count once; with programmatic dependent launches a kernel starts (and is timed) while it waits for the one
    before it, so the sum of kernel times would count that wait twice."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def kernel_ms(fn: Callable[[], object], steps: int = 5) -> tuple[float, list[str]]:
    """GPU busy time per call of ``fn`` (the time at least one CUDA kernel or copy runs, from the profiler, graph
    replays included; ``busy_us``) and the five costliest kernels: step time minus this is launch gaps and host
    time. A kernel's own time includes any wait at its start for the kernel before it (dependent launches)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total_us = busy_us([(e.time_range.start, e.time_range.end) for e in prof.events()
                        if e.device_type == DeviceType.CUDA and e.device_time > 0]) / steps
    launches = sum(e.count for e in events) / steps
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:5]
    return total_us / 1e3, [f"{launches:.0f} kernels per step"] + [
        f"{e.key[:60]}: {e.self_device_time_total / steps:.0f} us x{e.count // steps}" for e in top]


def host_profile(fn: Callable[[], object], calls: int = 50, top: int = 12) -> str:
    """cProfile of ``calls`` calls of ``fn`` (each followed by a device sync): where the host time goes."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    for _ in range(calls):
        prof.enable()
        fn()
        prof.disable()
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


class DecodeSetup:
    """One KV cache and backend for the largest batch: ``max(batch_sizes)`` requests holding ``context``
    cached tokens (random K/V: as good as real for timing) and one new slot each."""

    def __init__(self, adapter: torch.nn.Module, cfg: BenchConfig, backend_name: str, dtype: torch.dtype) -> None:
        from compile_attn import KVCache, create_backend

        layers = adapter.attention_layers()
        max_bs = max(cfg.batch_sizes)
        self.kv = KVCache(num_layers=len(layers), num_kv_heads=layers[0].num_kv_heads, head_dim=layers[0].head_dim,
                          max_batch_size=max_bs, max_context=cfg.context + 8, kv_cache_tokens=max_bs * (cfg.context + 1),
                          dtype=dtype, device=cfg.device)
        self.backend = create_backend(backend_name, self.kv, layers)
        self.rows = [self.kv.alloc_request() for _ in range(max_bs)]
        self.kv.alloc_extend(self.rows, [cfg.context] * max_bs)
        for k, v in zip(self.kv.pool.k_buffers, self.kv.pool.v_buffers):
            k.normal_(), v.normal_()
        self.new_slots = self.kv.alloc_extend(self.rows, [1] * max_bs)
        self.cfg = cfg

    def batch(self, bs: int):
        from compile_attn import ForwardBatch

        return ForwardBatch.build(req_pool_indices=self.rows[:bs], prefix_lens=[self.cfg.context] * bs,
                                  extend_lens=[1] * bs, out_cache_loc=self.new_slots[:bs], device=self.cfg.device)


def make_runner(adapter: torch.nn.Module, setup: DecodeSetup, cfg: BenchConfig, mode: str) -> tuple:
    """(GraphRunner with every batch size captured, the model it runs, its capture stats) for ``mode``."""
    from compile_attn import GraphConfig
    from compile_attn.compiler.compiled_model import compile_model
    from compile_attn.graph_runner.runner import GraphRunner

    torch._dynamo.reset()
    sizes = tuple(sorted(cfg.batch_sizes))
    # the compile backend's piecewise wrappers capture the bucket each of the runner's steps names
    options = {"cache_dir": None, **cfg.compile_options()}
    model = adapter if mode in ("none", "breakable") else compile_model(adapter, options)
    config = GraphConfig(mode=mode, decode_batch_sizes=sizes, extend_token_sizes=sizes, cache_dir=None)
    runner = GraphRunner(model, setup.backend, config, max_batch_size=sizes[-1], max_num_tokens=sizes[-1])
    return runner, model, runner.capture()


def bench_compile_attn(adapter: torch.nn.Module, setup: DecodeSetup, cfg: BenchConfig, mode: str, floors: dict,
                       ) -> list[Row]:
    """Decode step time per batch size through one GraphRunner in ``mode`` (the model compiled with
    backend="compile_attn" unless the mode is none or breakable), every batch size a captured bucket."""
    runner, model, stats = make_runner(adapter, setup, cfg, mode)
    rows = []
    for bs in cfg.batch_sizes:
        fb = setup.batch(bs)
        route = runner.route(fb)
        name = f"compile_attn {setup.backend.name} {mode} ({route[0].value if route else 'eager'})"
        with torch.inference_mode():
            ms = _timed(lambda: runner.run(fb), cfg)
            graph = runner._graphs.get(route) if route and route[0].value == "full" else None
            replay = _timed(graph.replay, cfg) if graph is not None and cfg.device == "cuda" else None
            # last: after a profiler session, graph replays in this process run slower (CUPTI stays attached)
            busy, top = kernel_ms(lambda: runner.run(fb)) if cfg.profile and cfg.device == "cuda" else (None, [])
            if cfg.profile and cfg.device == "cuda" and bs == min(cfg.batch_sizes):
                logger.info("host profile of runner.run, %s bs %d:\n%s", name, bs, host_profile(lambda: runner.run(fb)))
        rows.append(Row(name, bs, ms, floors[bs], busy, top, stats.graph_memory_bytes / 2**20, replay))
        logger.info("%s", rows[-1])
    runner = model = None  # noqa: F841 - drop the graphs before the next mode's runner is built
    return rows


def bench_hf(model: torch.nn.Module, cfg: BenchConfig, kind: str, bs: int) -> tuple[float, float | None, list[str]]:
    """HF decode step with a cache holding ``context`` tokens: dynamic cache (eager) or static cache compiled
    with ``mode="reduce-overhead"`` (CUDA graphs). Returns (ms, kernel ms, top kernels)."""
    from transformers import DynamicCache, StaticCache

    torch._dynamo.reset()
    prompt = torch.randint(0, cfg.shape["vocab_size"], (bs, cfg.context), device=cfg.device)
    if kind == "eager":
        cache = DynamicCache(config=model.config)
        forward = model
    else:
        cache = StaticCache(config=model.config, max_cache_len=cfg.context + 4 * (cfg.warmup + cfg.iters) + 16)
        forward = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.inference_mode():
        model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = prompt[:, -1:]
        step = {"pos": cfg.context}

        def decode() -> None:
            pos = torch.full((1,), step["pos"], device=cfg.device, dtype=torch.long)
            forward(token, past_key_values=cache, use_cache=True, cache_position=pos)
            step["pos"] += 1

        ms = _timed(decode, cfg)
        busy, top = kernel_ms(decode) if cfg.profile and cfg.device == "cuda" else (None, [])
    cache = forward = None  # noqa: F841 - free the static cache and compiled graphs before the next baseline
    return ms, busy, top


def run(cfg: BenchConfig) -> list[Row]:
    """Every HF baseline and compile_attn (backend x mode) at every batch size, one model, one process."""
    from compile_attn.hf import HFModelAdapter

    dtype = torch.bfloat16 if cfg.device == "cuda" else torch.float32
    model = _hf_model(cfg, "sdpa", dtype)
    floors = {bs: floor_ms(model, cfg, bs, dtype) for bs in cfg.batch_sizes}
    rows: list[Row] = []
    for kind in cfg.hf_baselines:
        for bs in cfg.batch_sizes:
            ms, busy, top = bench_hf(model, cfg, kind, bs)
            rows.append(Row(f"HF {kind}", bs, ms, floors[bs], busy, top))
            logger.info("%s", rows[-1])
            _release(cfg)
    adapter = HFModelAdapter(model)  # switches the same weights to attn_implementation="compile_attn"
    for backend in cfg.backends:
        setup = DecodeSetup(adapter, cfg, backend, dtype)
        for mode in cfg.modes:
            rows += bench_compile_attn(adapter, setup, cfg, mode, floors)
            _release(cfg)
        del setup
    torch._dynamo.reset()
    return rows


def _release(cfg: BenchConfig) -> None:
    import gc

    gc.collect()
    if cfg.device == "cuda":
        torch.cuda.empty_cache()


def to_markdown(rows: list[Row]) -> str:
    def opt(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    lines = ["| system | bs | ms / step | graph replay ms | GPU busy ms | floor ms | x floor |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.system} | {r.batch_size} | {r.ms:.3f} | {opt(r.replay_ms)} | {opt(r.kernel_ms)} | "
              f"{r.floor_ms:.3f} | {r.floor_ratio:.2f} |" for r in rows]
    return "\n".join(lines)


def to_json(rows: list[Row], cfg: BenchConfig) -> str:
    return json.dumps({"config": asdict(cfg), "rows": [asdict(r) | {"x_floor": r.floor_ratio} for r in rows]},
                      indent=1, default=str)
