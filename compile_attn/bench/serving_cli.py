"""The ``compile-attn bench-serve`` subcommand: options, their checks (before any model loads) and the command that
runs ``compile_attn.bench.serving`` and prints its table and JSON."""

from __future__ import annotations

import argparse
import json
import math
import os

import torch

from compile_attn.bench.workloads import WORKLOADS
from compile_attn.cli_options import add_engine_options, check_engine_options
from compile_attn.server.frontend import FRONTENDS


def add_parser(sub: argparse._SubParsersAction, formatter_class: type[argparse.HelpFormatter]) -> None:
    p = sub.add_parser("bench-serve", formatter_class=formatter_class,
                       help="serving benchmark: TTFT / ITL percentiles and output tok/s at request rates",
                       description="Send a seeded workload as streaming /v1/completions requests to an "
                                   "OpenAI-compatible server (started here, or at --url) at each request rate "
                                   "(Poisson arrivals; 'inf' sends all at once) and report TTFT, ITL, TPOT and e2e "
                                   "p50/p99 and output tok/s as a table and JSON.")
    p.add_argument("--workload", choices=WORKLOADS, default="fixed", help="see `compile-attn throughput -h`")
    p.add_argument("--num-seqs", type=int, default=None, help="requests (default: the workload's)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (nanovllm: the longest)")
    p.add_argument("--output-len", type=int, default=None, help="new tokens (nanovllm: the longest)")
    p.add_argument("--temperature", type=float, default=None, help="override the workload's temperature")
    p.add_argument("--request-rates", default="inf",
                   help="comma-separated requests per second; 'inf': all at once; 'half': half the request "
                        "throughput of the 'inf' run before it (half load). Started here, a 'half' run is followed "
                        "by the prefill and decode-step times its TTFT and ITL are held against")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    p.add_argument("--num-warmup", type=int, default=2, help="requests sent before the timed runs")
    p.add_argument("--seed", type=int, default=0, help="seeds the arrival times")
    p.add_argument("--client-processes", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)),
                   help="client processes the requests are dealt to (default: a quarter of the CPU cores, 1 to 4); "
                        "the table's 'client busy' near 100%% says the client set the pace: raise it")
    p.add_argument("--url", default=None, help="a running server's base URL (e.g. http://127.0.0.1:8000); "
                                               "without it a server is started in this process")
    p.add_argument("--served-model-name", default=None, help="the model name requests carry (with --url: the "
                                                             "server's)")
    p.add_argument("--vocab-size", type=int, default=None, help="with --url: prompt ids are drawn below it "
                                                                "(default 10001)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", default=None, help="a local HF model directory (default: random weights of the "
                                                     "Llama-3.2-1B shape)")
    model.add_argument("--tiny", action="store_true", help="a small model with random weights")
    p.add_argument("--frontend", choices=FRONTENDS, default="process",
                   help="where the server started here runs its HTTP front end: a process of its own, or a thread "
                        "of the engine's process (whose per-token work then competes with the step loop)")
    p.add_argument("--offline", action="store_true",
                   help="first time LLM.generate on the same workload and engine, and report each rate against it")
    p.add_argument("--offline-rounds", type=int, default=2,
                   help="offline rounds; the last one counts, the ones before warm up (default 2)")
    add_engine_options(p, device_help="cuda or cpu (default: cuda if there is one)", max_batch_size=256,
                       max_num_tokens=8192, max_context_help="default: the workload's longest request")
    p.add_argument("--response-format", choices=("json_object",), default=None,
                   help="send every request with this response_format (structured outputs: the grammar masks each "
                        "token; needs the xgrammar package and a model with a tokenizer: --model DIR or --url), to "
                        "report its output tok/s beside a plain run's. A request ends once its JSON object is "
                        "complete, so fewer tokens than --output-len may come")
    p.add_argument("--out", default=None, help="write JSON here (results, with the command, versions and commit)")
    p.set_defaults(func=cmd_bench_serve, prepare=prepare, subparser=p)


def _rates(text: str) -> list[float | str]:
    words = [x.strip() for x in text.split(",")]
    try:
        rates = [w if w == "half" else math.inf if w == "inf" else float(w) for w in words]
    except ValueError:
        raise ValueError(f"--request-rates takes comma-separated numbers, 'inf' or 'half', got {text!r}") from None
    if any(not isinstance(r, str) and not r > 0 for r in rates):
        raise ValueError(f"--request-rates must be > 0, got {text!r}")
    if "half" in rates and math.inf not in rates[:rates.index("half")]:
        raise ValueError(f"--request-rates: 'half' is half the throughput of an 'inf' run, so 'inf' must come "
                         f"before it (e.g. inf,half), got {text!r}")
    return rates


def prepare(args: argparse.Namespace) -> None:
    """Refuse bad options (ValueError naming the value) and set ``args.cfg``, the ServingBenchConfig."""
    from compile_attn.bench.throughput_cli import throughput_config
    from compile_attn.bench.serving import ServingBenchConfig

    check_engine_options(args)
    for name in ("num_seqs", "prompt_len", "output_len", "max_concurrency", "vocab_size", "client_processes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.offline_rounds < 1:
        raise ValueError(f"--offline-rounds must be >= 1, got {args.offline_rounds}")
    if args.num_warmup < 0:
        raise ValueError(f"--num-warmup must be >= 0, got {args.num_warmup}")
    if args.temperature is not None and args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if args.url is not None and (args.model or args.tiny or args.offline):
        raise ValueError("--url benchmarks a running server: --model, --tiny and --offline start one here; drop one")
    if args.response_format is not None and args.url is None and args.model is None:
        raise ValueError("--response-format needs a model with a tokenizer: --model DIR (random weights have none), "
                         "or --url of a server")
    if args.response_format is not None and args.offline:
        raise ValueError("--response-format applies to the served requests only; drop --offline (its LLM.generate "
                         "rounds would run without it)")
    if args.url is not None and not args.url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {args.url!r}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    engine = throughput_config(args, device, hf=False)
    args.cfg = ServingBenchConfig(engine=engine, url=args.url, served_model_name=args.served_model_name,
                                  vocab_size=args.vocab_size, request_rates=_rates(args.request_rates),
                                  max_concurrency=args.max_concurrency, num_warmup=args.num_warmup,
                                  offline=args.offline, offline_rounds=args.offline_rounds,
                                  client_processes=args.client_processes, seed=args.seed, frontend=args.frontend,
                                  response_format=args.response_format)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from compile_attn.bench.run_info import run_info
    from compile_attn.bench import serving as bench_serving

    result = bench_serving.run(args.cfg)
    print(bench_serving.to_markdown(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps({"run": run_info(args.argv), **result}, indent=1, default=str))
    return 0
