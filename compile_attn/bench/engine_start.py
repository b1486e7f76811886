"""Engine benchmark: cold and warm start, prefill throughput, graph and KV memory, through ``compile_attn.LLM``.

Each start runs in a fresh Python process (``python -m compile_attn.bench.engine_start --child ...``) so nothing is
warm that a user's process would not have: cold = empty compile_attn, Inductor and Triton caches; warm = a
second process over the caches the first one filled. Python's bytecode cache is one of them
(``bytecode_cache``, default on): a pip install ships ``.pyc`` files, but where a process finds none it may
not write (torch installed without them, or ``PYTHONDONTWRITEBYTECODE`` with a ``PYTHONPYCACHEPREFIX`` that
holds none) it compiles ~2,000 torch modules from source, seconds that no user's warm start pays. The children
get their own ``PYTHONPYCACHEPREFIX`` in the benchmark's temporary folder and may write there, so the cold
start compiles and writes the bytecode and the warm start reads it. Start time is ``LLM(...)`` construction
with the default buckets (compile + capture); the model's random init is excluded. In the same process,
prefill throughput: ``requests x prompt_len`` prompt tokens in one step (``max_new_tokens=1``), timed after
one warm-up, with the FLOPs it must do (linear layers per token, causal attention, the LM head on the sampled
rows only) over the measured bf16 matmul peak, and (CUDA) the step's GPU busy time from the profiler, taken
after the timed runs: prefill wall time minus it is the host time the GPU waited for.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import os
import pstats
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

from compile_attn.env import start_profile_prefix

logger = logging.getLogger(__name__)

PEAK_BF16_FLOPS = 790e12  # the reference GPU's dense bf16 matmul peak as measured, not its spec sheet's


@dataclass
class EngineBenchConfig:
    shape: dict = field(default_factory=dict)
    backend: str = "auto"
    requests: int = 8
    prompt_len: int = 1024
    max_batch_size: int = 256
    max_num_tokens: int = 8192
    kv_cache_tokens: int = 256 * 640
    iters: int = 5
    peak_flops: float = PEAK_BF16_FLOPS
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    bytecode_cache: bool = True  # the children write and read .pyc files in the benchmark's temporary folder
    compile_options: dict = field(default_factory=dict)  # GraphConfig fields for LLM(compile_options=...)


def prefill_flops(shape: dict, requests: int, prompt_len: int) -> float:
    """Matmul FLOPs of one prefill step of ``requests`` prompts of ``prompt_len`` tokens."""
    h, layers, d = shape["hidden_size"], shape["num_hidden_layers"], shape["head_dim"]
    hq, hkv, inter = shape["num_attention_heads"], shape["num_key_value_heads"], shape["intermediate_size"]
    per_token_layer = h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * inter  # qkv, o, gate/up/down weights
    linear = 2 * per_token_layer * layers * requests * prompt_len
    causal_pairs = prompt_len * (prompt_len + 1) / 2
    attention = 2 * 2 * hq * d * causal_pairs * layers * requests  # QK^T and PV
    lm_head = 2 * h * shape["vocab_size"] * requests  # logits for each request's last token only
    return linear + attention + lm_head


def child(cfg: EngineBenchConfig, cache_dir: str) -> dict:
    """One process: build the model, time ``LLM(...)`` (compile + capture), then time prefill."""
    from compile_attn.bench import decode_step as bench
    from compile_attn.engine import LLM, SamplingParams

    dtype = torch.bfloat16 if cfg.device == "cuda" else torch.float32
    model = bench._hf_model(bench.BenchConfig(shape=cfg.shape, device=cfg.device), "sdpa", dtype)
    sync = torch.cuda.synchronize if cfg.device == "cuda" else (lambda: None)
    sync()
    profile_to = start_profile_prefix()  # a file prefix: where the start's cProfile goes
    profiler = cProfile.Profile() if profile_to else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    llm = LLM(model, attn_backend=cfg.backend, max_batch_size=cfg.max_batch_size, max_num_tokens=cfg.max_num_tokens,
              kv_cache_tokens=cfg.kv_cache_tokens, max_context=cfg.prompt_len + 64, device=cfg.device, dtype=dtype,
              compile_options={**cfg.compile_options, "cache_dir": cache_dir})
    sync()
    ready_s = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(f"{profile_to}.{os.getpid()}.prof")  # the whole profile, for pstats / snakeviz
        with open(f"{profile_to}.{os.getpid()}.txt", "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(45)
    stats = llm.step_runner.runner.stats
    options = {k: v for k, v in getattr(llm.step_runner.runner.model, "options", {}).items() if k != "cache_dir"}
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.shape["vocab_size"], (cfg.requests, cfg.prompt_len), generator=gen).tolist()
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up
    times = []
    for _ in range(cfg.iters):
        sync()
        t0 = time.perf_counter()
        steps = llm.num_steps
        llm.generate(prompts, params)
        sync()
        times.append(time.perf_counter() - t0)
        assert llm.num_steps - steps == 1, "the prefill did not run as one step; raise max_num_tokens"
    prefill_s = sorted(times)[len(times) // 2]
    # GPU busy time of the same step (kernels and copies), profiled last: wall minus busy is host time and gaps.
    busy_ms = bench.kernel_ms(lambda: llm.generate(prompts, params), steps=3)[0] if cfg.device == "cuda" else None
    flops = prefill_flops(cfg.shape, cfg.requests, cfg.prompt_len)
    return dict(
        backend=llm.backend.name, compile_options=options, ready_s=ready_s, capture_s=stats.capture_seconds,
        first_capture_s=stats.first_capture_seconds, capture_s_by_mode=dict(stats.capture_seconds_by_mode),
        graphs=dict(stats.captures), graph_mib=stats.graph_memory_bytes / 2**20,
        kv_mib=llm.kv_cache.pool.bytes / 2**20, prefill_ms=prefill_s * 1e3, prefill_gpu_busy_ms=busy_ms,
        prefill_tokens_per_s=cfg.requests * cfg.prompt_len / prefill_s, prefill_tflops=flops / prefill_s / 1e12,
        prefill_pct_peak=100 * flops / prefill_s / cfg.peak_flops,
    )


def run(cfg: EngineBenchConfig) -> dict:
    """Cold start then warm start, each in a fresh process over the same (initially empty) cache folders."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="compile_attn_bench_") as tmp:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        if cfg.bytecode_cache:
            env["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")
            env.pop("PYTHONDONTWRITEBYTECODE", None)
        for start in ("cold", "warm"):
            cmd = [sys.executable, "-m", "compile_attn.bench.engine_start", "--child", json.dumps(asdict(cfg)),
                   "--cache-dir", os.path.join(tmp, "compile_attn")]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"{start} start process failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
            results[start] = json.loads(proc.stdout.strip().splitlines()[-1])
            logger.info("%s start: %s", start, results[start])
    return results


def to_markdown(results: dict, cfg: EngineBenchConfig) -> str:
    lines = [
        f"| start | backend | ready s (compile + capture) | capture s | first graph s (with compile) | "
        f"capture s per mode | graphs | graph MiB | KV MiB | "
        f"prefill {cfg.requests}x{cfg.prompt_len} ms | its GPU busy ms | tokens/s | TFLOP/s | "
        f"% of {cfg.peak_flops / 1e12:.0f} |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for start, r in results.items():
        graphs = ", ".join(f"{k} {v}" for k, v in sorted(r["graphs"].items()))
        by_mode = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r.get("capture_s_by_mode", {}).items())) or "-"
        busy = "-" if r.get("prefill_gpu_busy_ms") is None else f"{r['prefill_gpu_busy_ms']:.1f}"
        lines.append(
            f"| {start} | {r['backend']} | {r['ready_s']:.1f} | {r['capture_s']:.1f} | "
            f"{r.get('first_capture_s', 0.0):.1f} | {by_mode} | {graphs} | {r['graph_mib']:.0f} | "
            f"{r['kv_mib']:.0f} | {r['prefill_ms']:.1f} | {busy} | {r['prefill_tokens_per_s']:.0f} | "
            f"{r['prefill_tflops']:.0f} | {r['prefill_pct_peak']:.0f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="internal: one start of the engine benchmark (a fresh process)")
    parser.add_argument("--child", required=True, help="EngineBenchConfig as JSON")
    parser.add_argument("--cache-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cfg = EngineBenchConfig(**json.loads(args.child))
    print(json.dumps(child(cfg, args.cache_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
