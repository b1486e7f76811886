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


@dataclass
class Row:
    system: str
    batch_size: int
    ms: float
    floor_ms: float

    @property
    def floor_ratio(self) -> float:
        return self.ms / self.floor_ms


def _timed(fn: Callable[[], object], cfg: BenchConfig) -> float:
    """Median milliseconds of ``fn`` over ``cfg.iters`` runs after ``cfg.warmup``."""
    for _ in range(cfg.warmup):
        fn()
    times = []
    cuda = cfg.device == "cuda"
    for _ in range(cfg.iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _hf_model(cfg: BenchConfig, attn: str, dtype: torch.dtype):  # noqa: ANN202
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg.shape)).to(cfg.device, dtype).eval()
    if attn != "sdpa":
        model.set_attn_implementation(attn)
    return model


def floor_ms(model: torch.nn.Module, cfg: BenchConfig, bs: int, dtype: torch.dtype) -> float:
    """Bytes a decode step must read (every weight once, every cached K and V once) over the bandwidth."""
    weights = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    s = cfg.shape
    kv = bs * cfg.context * s["num_hidden_layers"] * 2 * s["num_key_value_heads"] * s["head_dim"] * dtype.itemsize
    return (weights + kv) / cfg.bandwidth * 1e3


def bench_compile_attn(cfg: BenchConfig, backend_name: str, mode: str, bs: int, dtype: torch.dtype) -> tuple[float, str]:
    """Decode step time through the GraphRunner (model compiled with backend="compile_attn" unless mode is none)."""
    from compile_attn import ForwardBatch, GraphConfig, KVCache, create_backend
    from compile_attn.compiler.compiled_model import compile_model
    from compile_attn.graph_runner.runner import GraphRunner
    from compile_attn.hf import HFModelAdapter

    adapter = HFModelAdapter(_hf_model(cfg, "compile_attn", dtype))
    layers = adapter.attention_layers()
    kv = KVCache(num_layers=len(layers), num_kv_heads=layers[0].num_kv_heads, head_dim=layers[0].head_dim,
                 max_requests=bs, max_context=cfg.context + cfg.warmup + cfg.iters + 8,
                 num_tokens=bs * (cfg.context + 1), dtype=dtype, device=cfg.device)
    backend = create_backend(backend_name, kv, layers)
    rows = [kv.alloc_request() for _ in range(bs)]
    kv.alloc_extend(rows, [cfg.context] * bs)  # cached tokens: random K/V is as good as real for timing
    for k, v in zip(kv.pool.k_buffers, kv.pool.v_buffers):
        k.normal_(), v.normal_()
    model = adapter if mode in ("none", "breakable") else compile_model(adapter)  # breakable: eager model
    runner = GraphRunner(model, backend, GraphConfig(mode=mode, decode_batch_sizes=(bs,), prefill_token_sizes=(bs,),
                                                     cache_dir=None), max_batch_size=bs, max_num_tokens=bs)
    runner.capture()
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[cfg.context] * bs, extend_lens=[1] * bs,
                            out_cache_loc=kv.alloc_extend(rows, [1] * bs), device=cfg.device)
    with torch.inference_mode():
        ms = _timed(lambda: runner.run(fb), cfg)
    route = runner.route(fb)
    return ms, route[0].value if route else "eager"


def bench_hf(cfg: BenchConfig, kind: str, bs: int, dtype: torch.dtype) -> float:
    """HF decode step with a cache holding ``context`` tokens: dynamic cache (eager) or static cache compiled
    with ``mode="reduce-overhead"``."""
    from transformers import DynamicCache, StaticCache

    model = _hf_model(cfg, "sdpa", dtype)
    prompt = torch.randint(0, cfg.shape["vocab_size"], (bs, cfg.context), device=cfg.device)
    if kind == "eager":
        cache = DynamicCache(config=model.config)
        forward = model
    else:
        cache = StaticCache(config=model.config, max_cache_len=cfg.context + cfg.warmup + cfg.iters + 8)
        forward = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.inference_mode():
        model(prompt, past_key_values=cache, use_cache=True)
        token = prompt[:, -1:]
        step = {"pos": cfg.context}

        def decode() -> None:
            pos = torch.full((1,), step["pos"], device=cfg.device, dtype=torch.long)
            forward(token, past_key_values=cache, use_cache=True, cache_position=pos)
            step["pos"] += 1

        return _timed(decode, cfg)


def run(cfg: BenchConfig) -> list[Row]:
    dtype = torch.bfloat16 if cfg.device == "cuda" else torch.float32
    rows: list[Row] = []
    for bs in cfg.batch_sizes:
        floor = floor_ms(_hf_model(cfg, "sdpa", dtype), cfg, bs, dtype)
        for backend in cfg.backends:
            for mode in cfg.modes:
                ms, route = bench_compile_attn(cfg, backend, mode, bs, dtype)
                rows.append(Row(f"compile_attn {backend} {mode} ({route})", bs, ms, floor))
                logger.info("%s", rows[-1])
        for kind in cfg.hf_baselines:
            rows.append(Row(f"HF {kind}", bs, bench_hf(cfg, kind, bs, dtype), floor))
            logger.info("%s", rows[-1])
    return rows


def to_markdown(rows: list[Row]) -> str:
    lines = ["| system | bs | ms / step | floor ms | x floor |", "|---|---|---|---|---|"]
    lines += [f"| {r.system} | {r.batch_size} | {r.ms:.3f} | {r.floor_ms:.3f} | {r.floor_ratio:.2f} |" for r in rows]
    return "\n".join(lines)


def to_json(rows: list[Row], cfg: BenchConfig) -> str:
    return json.dumps({"config": asdict(cfg), "rows": [asdict(r) | {"x_floor": r.floor_ratio} for r in rows]},
                      indent=1, default=str)
