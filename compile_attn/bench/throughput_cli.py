"""The ``compile-attn throughput WORKLOAD`` subcommand: its options, their checks (before any model is built) and
the command that runs ``compile_attn.bench.throughput`` and writes its table and JSON."""

from __future__ import annotations

import argparse
import math
import json
import logging

from typing import TYPE_CHECKING

import torch

from compile_attn.bench.workloads import ALL_WORKLOADS
from compile_attn.cli_options import add_engine_options, check_engine_options

if TYPE_CHECKING:
    from compile_attn.bench.throughput import ThroughputConfig


def add_parser(sub: argparse._SubParsersAction, formatter_class: type[argparse.HelpFormatter]) -> None:
    p = sub.add_parser("throughput", formatter_class=formatter_class,
                       help="serving throughput on a seeded workload: first and later rounds, and HF generate_batch",
                       description="Run a seeded workload through compile_attn.LLM twice (right after start-up, then "
                                   "again) and through HF transformers' generate_batch: tok/s, steps and time per "
                                   "step kind, GPU busy fraction, start-up time.")
    p.add_argument("workload", choices=ALL_WORKLOADS,
                   help="nanovllm: nano-vllm's bench (256 prompts of 100-1024 random ids, 100-1024 new tokens, "
                        "temperature 0.6); fixed: N x (P prompt + O new), greedy; long-context: fixed at 32 x (7,680 + 256), "
                        "for the KV cache dtype (--kv-cache-dtype); shared-prefix: N (256) prompts of "
                        "one P-token (2,048) system prompt + 32 own tokens, O (128) new, greedy; multi-turn: N (64) "
                        "conversations x 4 turns, a first prompt of P (1,024) tokens, each turn resending the history "
                        "and the answer (O, 128 tokens) + P/8 new tokens, greedy. The last two run with the prefix "
                        "cache on, then off. arrivals: N (512) requests arriving at --request-rate (128/s, Poisson), "
                        "log-normal prompt and output lengths of median P (1,024) and O (192), temperature 0.6")
    p.add_argument("--num-seqs", type=int, default=None,
                   help="requests; multi-turn: conversations (default: 256; long-context 32, multi-turn 64)")
    p.add_argument("--prompt-len", "--max-input", dest="prompt_len", type=int, default=None,
                   help="prompt tokens; nanovllm: the longest prompt; shared-prefix: the shared system prompt; "
                        "multi-turn: the first turn's (default: nanovllm 1024, fixed 256, long-context 7680, "
                        "shared-prefix 2048, "
                        "multi-turn 1024)")
    p.add_argument("--output-len", "--max-output", dest="output_len", type=int, default=None,
                   help="new tokens; nanovllm: the longest output (default: nanovllm 1024, fixed 128, "
                        "long-context 256)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="arrivals: requests per second, a Poisson process (default 128)")
    p.add_argument("--temperature", type=float, default=None,
                   help="override the workload's temperature (0: greedy)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", default=None, help="a local HF model directory or Hugging Face model id (default: "
                                                     "random weights of the Llama-3.2-1B shape)")
    model.add_argument("--tiny", action="store_true", help="a small model with random weights, on the CPU")
    add_engine_options(p, device_help="cuda or cpu (default: cuda if there is one; cpu with --tiny)",
                       max_batch_size=256, max_num_tokens=8192,
                       max_context_help="tokens per request at most (default: the workload's longest request)")
    p.add_argument("--rounds", type=int, default=2, help="times the workload runs on the same LLM (>= 1)")
    p.add_argument("--profile-steps", type=int, default=32,
                   help="steps per GPU-busy window (CUDA; 0: no profile round)")
    p.add_argument("--no-hf", action="store_true", help="skip HF transformers' generate_batch")
    p.add_argument("--hf-rounds", type=int, default=None, help="HF's rounds (default: --rounds)")
    p.add_argument("--hf-max-memory-percent", type=float, default=0.8,
                   help="fraction of free memory HF's KV cache may take (its ContinuousBatchingConfig)")
    p.add_argument("--out", default=None, help="write JSON here (results, with the command, versions and commit)")
    p.set_defaults(func=cmd_throughput, prepare=prepare, subparser=p)


def prepare(args: argparse.Namespace) -> None:
    """Refuse bad options (ValueError naming the value) and set ``args.cfg``, the ThroughputConfig."""
    check_engine_options(args)
    for name in ("num_seqs", "prompt_len", "output_len", "rounds", "hf_rounds"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.profile_steps < 0:
        raise ValueError(f"--profile-steps must be >= 0 (0: no profile), got {args.profile_steps}")
    if args.request_rate is not None and args.workload != "arrivals":
        raise ValueError(f"--request-rate is for the arrivals workload, not {args.workload}")
    if args.request_rate is not None and not (args.request_rate > 0 and math.isfinite(args.request_rate)):
        raise ValueError(f"--request-rate must be a finite number > 0 (requests per second), got {args.request_rate}")
    if args.temperature is not None and args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if not 0 < args.hf_max_memory_percent <= 1:
        raise ValueError(f"--hf-max-memory-percent must be in (0, 1], got {args.hf_max_memory_percent}")
    device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"--device must be cuda or cpu, got {device!r}")
    args.cfg = throughput_config(args, device, rounds=args.rounds, profile_steps=args.profile_steps, hf=not args.no_hf,
                                 hf_rounds=args.hf_rounds, hf_max_memory_percent=args.hf_max_memory_percent)
    if device == "cpu" and not args.tiny and args.model is None:
        logging.getLogger(__name__).warning(
            "throughput: the Llama-3.2-1B shape on the CPU takes hours and ~10 GB of memory; --tiny runs a small model")


def throughput_config(args: argparse.Namespace, device: str, **fields: object) -> ThroughputConfig:
    """The ThroughputConfig of the workload options and the engine options (``add_engine_options``) in ``args``,
    on ``device``; ``fields`` set the command's own (rounds, HF)."""
    from compile_attn.bench import decode_step as bench
    from compile_attn.bench.throughput import ThroughputConfig
    from compile_attn.hub import resolve_model

    model = resolve_model(args.model, revision=args.revision) if args.model else None  # a directory or model id
    return ThroughputConfig(
        workload=args.workload, num_seqs=args.num_seqs, prompt_len=args.prompt_len, output_len=args.output_len,
        request_rate=getattr(args, "request_rate", None),
        temperature=args.temperature, model=model, shape=dict(bench.TINY if args.tiny else bench.LLAMA_1B),
        device=device, backend=args.backend, graph_mode=args.graph_mode, compile=not args.no_compile,
        max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens, kv_cache_tokens=args.kv_cache_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, page_size=args.page_size, max_context=args.max_context,
        overlap=not args.no_overlap, prefix_cache=not args.no_prefix_cache,
        cascade_decode=None if args.cascade_decode is None else args.cascade_decode == "on",
        speculative_config=args.speculative_config, kv_cache_dtype=args.kv_cache_dtype,
        kv_scales_path=args.kv_scales_path, tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype,
        disable_custom_all_reduce=args.disable_custom_all_reduce, seed=args.seed, **fields,
    )


def cmd_throughput(args: argparse.Namespace) -> int:
    from compile_attn.bench import throughput as bench_throughput
    from compile_attn.bench.run_info import run_info

    result = bench_throughput.run(args.cfg)
    print(bench_throughput.to_markdown(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps({"run": run_info(args.argv), **result}, indent=1, default=str))
    return 0
