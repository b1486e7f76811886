"""The ``compile-attn`` command: ``generate`` text with a model, ``info`` about this machine's backends, ``bench``
decode steps and engine starts (``compile_attn.bench.decode_step``, ``compile_attn.bench.engine_start``), ``throughput`` on a serving
workload (``compile_attn.bench.throughput``), ``serve`` an OpenAI-compatible server and ``bench-serve`` it
(``compile_attn.server``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch

from compile_attn.cli_options import add_engine_options, check_engine_options, engine_config
from compile_attn.config import parse_compile_sizes
from compile_attn.errors import CompileAttnError
from compile_attn.bench.run_info import package_versions, run_info

TINY_MODEL = "tiny"  # built-in, random weights
TRAINED_MODEL = "tiny-llama"  # a tiny Llama trained on the CPU on first use (compile_attn.models.tiny_llama)
RANDOM_WEIGHTS = "random weights: the text is meaningless; "

logger = logging.getLogger(__name__)


def cmd_info(args: argparse.Namespace) -> int:
    from compile_attn.attention import available_backends, installed_backends, resolve_auto_backend

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [
        *((name, version or "-") for name, version in package_versions().items()),
        ("device", torch.cuda.get_device_name() if device.type == "cuda" else "cpu (no CUDA GPU)"),
        ("capability", "sm_%d%d" % torch.cuda.get_device_capability() if device.type == "cuda" else "-"),
        ("backends", ", ".join(installed_backends())),
        ("not installed", ", ".join(sorted(set(available_backends()) - set(installed_backends()))) or "-"),
        ("auto backend", resolve_auto_backend(device)),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _tiny_model() -> torch.nn.Module:
    from compile_attn.models import ToyDecoder, ToyDecoderConfig

    torch.manual_seed(0)
    return ToyDecoder(ToyDecoderConfig(vocab_size=256, hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=2,
                                       head_dim=16, intermediate_size=256))


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate with ``args.params`` (the SamplingParams that ``_prepare_generate`` built from the options)."""
    from compile_attn.engine import LLM

    if args.model == TINY_MODEL:
        logger.warning(RANDOM_WEIGHTS + "--model %s generates from a small trained model (trained once on the CPU), "
                       "--model DIR from a checkpoint", TRAINED_MODEL)
        model = _tiny_model()
    elif args.model == TRAINED_MODEL:
        from compile_attn.models.tiny_llama import default_tiny_llama_dir, is_trained, tiny_llama

        if not is_trained(default_tiny_llama_dir()):
            print(f"compile-attn generate: training {TRAINED_MODEL} into {default_tiny_llama_dir()} (first use only)",
                  file=sys.stderr, flush=True)
        model = str(tiny_llama())
    else:
        model = args.model
    llm = LLM(model, config=engine_config(args))
    params = args.params
    prompts: list = args.prompt
    if llm.tokenizer is None:  # the tiny model has no tokenizer: bytes are its tokens
        prompts = [list(p.encode()) for p in prompts]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)  # a bar of finished requests
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompt, outs):
        text = out.text if out.text is not None else bytes(t % 256 for t in out.token_ids).decode("latin-1")
        print(f"--- {prompt!r} -> ({len(out.token_ids)} tokens, {out.finish_reason})\n{text}")
    n = sum(len(o.token_ids) for o in outs)
    print(f"--- {n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tok/s, {llm.num_steps} steps)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark of ``args.cfg`` (the BenchConfig that ``_prepare_bench`` built from the options)."""
    from compile_attn.bench import decode_step as bench

    cfg = args.cfg
    logger.warning(RANDOM_WEIGHTS + "the benchmark times steps of a %s-shaped model with random weights, so its "
                   "timings hold for any weights but it makes no text", "tiny" if args.tiny else "Llama-3.2-1B")
    if args.engine_only:
        rows = []
    else:
        rows = bench.run(cfg)
        print(bench.to_markdown(rows), flush=True)
    engine = None
    if args.engine or args.engine_only:
        from compile_attn.bench import engine_start as bench_engine

        # the engine starts compile with the same options as the decode rows
        common = dict(shape=cfg.shape, backend=cfg.backends[0], bytecode_cache=not args.no_bytecode_cache,
                      compile_options=cfg.compile_options())
        ecfg = bench_engine.EngineBenchConfig(**common)
        if args.tiny:
            ecfg = bench_engine.EngineBenchConfig(**common, requests=2, prompt_len=64, max_batch_size=8,
                                                  max_num_tokens=128, kv_cache_tokens=1024)
        engine = bench_engine.run(ecfg)
        print(bench_engine.to_markdown(engine, ecfg), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps({"run": run_info(args.argv), "decode": json.loads(bench.to_json(rows, cfg)),
                                "engine": engine}, indent=1))
    return 0


HF_BASELINES = ("eager", "static_compiled")


class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Help that ends with the option's default, except for flags and options without one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compile-attn", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (and show tracebacks)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backends, GPU and versions on this machine").set_defaults(func=cmd_info)
    gen = sub.add_parser("generate", help="generate text", formatter_class=_ShowDefaults,
                         description="Generate text with compile_attn.LLM (a tiny built-in model by default).")
    gen.add_argument("--model", default=TINY_MODEL,
                     help=f"local HF model directory, Hugging Face model id (org/name: the local HF cache's copy, else "
                          f"downloaded), '{TRAINED_MODEL}' (a small Llama trained on the CPU on first use and cached), "
                          f"or '{TINY_MODEL}' (built-in, random weights)")
    gen.add_argument("--prompt", action="append", default=None,
                     help="a prompt (repeat for several; without it: one built-in prompt)")
    gen.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (>= 1)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1] (1: off)")
    gen.add_argument("--seed", type=int, default=None,
                     help="makes sampled outputs reproducible (the requests' seed, and the engine's as vLLM's --seed)")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS token")
    add_engine_options(gen, device_help="cuda or cpu (without it: cuda if there is one)", max_batch_size=8,
                       max_num_tokens=2048, max_context=512,
                       max_context_help="tokens per request at most (prompt + output)")
    gen.set_defaults(func=cmd_generate, prepare=_prepare_generate, subparser=gen)
    bench = sub.add_parser("bench", help="decode step time: compile_attn modes/backends vs HF, and the bandwidth floor",
                           formatter_class=_ShowDefaults)
    bench.add_argument("--tiny", action="store_true", help="a tiny model instead of the Llama-3.2-1B shape")
    bench.add_argument("--batch-sizes", default="1,16,64,256", help="comma-separated decode batch sizes")
    bench.add_argument("--context", type=int, default=512, help="cached tokens per request")
    bench.add_argument("--backend", default="auto", help="comma-separated backends")
    bench.add_argument("--modes", default="none,piecewise,full", help="comma-separated graph modes")
    bench.add_argument("--hf", default="eager,static_compiled",
                       help="comma-separated HF baselines (eager, static_compiled); '' for none")
    bench.add_argument("--iters", type=int, default=20, help="timed steps per measurement")
    bench.add_argument("--no-profile", action="store_true",
                       help="skip the per-step kernel-time profile (cleanest timings: a profiler session slows "
                            "later graph replays of the same process)")
    bench.add_argument("--inductor-config", default="{}",
                       help='Inductor config patches for the compiled pieces, JSON, e.g. \'{"combo_kernels": true}\'')
    bench.add_argument("--static-inductor-config", default="{}",
                       help="Inductor config patches for the static compiles (--compile-sizes) only, JSON, e.g. "
                            '\'{"triton.enable_pdl": true}\' (GraphConfig.static_inductor_config)')
    bench.add_argument("--compile-sizes", default="auto",
                       help="token counts compiled again with static shapes (GraphConfig.compile_sizes): 'auto' "
                            "(1 on a GPU), 'none', or comma-separated counts, e.g. 1,2")
    bench.add_argument("--no-fuse-linears", action="store_true",
                       help="keep q/k/v and gate/up as separate GEMMs (GraphConfig.fuse_linears=False)")
    bench.add_argument("--engine", action="store_true",
                       help="also cold/warm start, prefill throughput and memory through LLM (fresh processes)")
    bench.add_argument("--engine-only", action="store_true", help="only the --engine part")
    bench.add_argument("--no-bytecode-cache", action="store_true",
                       help="engine starts: keep this environment's bytecode settings (by default the start "
                            "processes share a .pyc cache, as a pip install has; see compile_attn.bench.engine_start)")
    bench.add_argument("--out", default=None, help="write JSON here (results, with the command, versions and commit)")
    bench.set_defaults(func=cmd_bench, prepare=_prepare_bench, subparser=bench)
    from compile_attn.bench.throughput_cli import add_parser as add_throughput_parser

    add_throughput_parser(sub, _ShowDefaults)
    from compile_attn.server.cli import add_parser as add_serve_parser

    add_serve_parser(sub, _ShowDefaults)
    from compile_attn.bench.serving_cli import add_parser as add_bench_serve_parser

    add_bench_serve_parser(sub, _ShowDefaults)
    return parser


def _prepare_generate(args: argparse.Namespace) -> None:
    """Refuse bad options before a model loads and compiles (minutes on a GPU): ValueError naming the value.
    Sets ``args.params``, the SamplingParams for ``cmd_generate``."""
    from compile_attn.engine import SamplingParams

    check_engine_options(args)
    if any(not p for p in args.prompt):
        raise ValueError("--prompt must not be empty")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.max_new_tokens >= args.max_context:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} leaves no room for a prompt in --max-context "
                         f"{args.max_context}; raise --max-context or lower --max-new-tokens")
    args.params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    if args.model not in (TINY_MODEL, TRAINED_MODEL):  # a directory or model id: ModelNotFoundError, as LLM() says
        from compile_attn.hub import resolve_model

        resolve_model(args.model, revision=args.revision)


def _positive_ints(option: str, text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{option} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{option} values must be >= 1, got {text!r}")
    return values


def _inductor_patches(option: str, text: str) -> dict:
    """A JSON object whose keys are ``torch._inductor.config`` options (nested ones dotted)."""
    patches = _json_object(option, text)
    if patches:
        import torch._inductor.config as inductor_config

        unknown = sorted(set(patches) - set(inductor_config.get_config_copy()))
        if unknown:
            raise ValueError(f"{option}: unknown Inductor option(s) {unknown} in torch {torch.__version__}; the names "
                             f"are those of torch._inductor.config, nested ones dotted (e.g. 'combo_kernels', "
                             f"'triton.enable_pdl')")
    return patches


def _json_object(option: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{option} must be a JSON object, e.g. '{{\"combo_kernels\": true}}': {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} must be a JSON object, got {text!r}")
    return value


def _prepare_bench(args: argparse.Namespace) -> None:
    """Refuse bad options before the benchmark builds its model (ValueError naming the value). Sets ``args.cfg``,
    the BenchConfig for ``cmd_bench``."""
    from compile_attn.bench import decode_step as bench
    from compile_attn.attention.registry import check_backend_installed, check_backend_name
    from compile_attn.graph_mode import GraphMode

    if args.context < 1 or args.iters < 1:
        raise ValueError(f"--context and --iters must be >= 1, got {args.context} and {args.iters}")
    backends, modes = args.backend.split(","), args.modes.split(",")
    for name in backends:
        check_backend_name(name)
        check_backend_installed(name)
    for mode in modes:
        GraphMode.parse(mode)
    hf = [b for b in args.hf.split(",") if b]
    unknown = [b for b in hf if b not in HF_BASELINES]
    if unknown:
        raise ValueError(f"unknown HF baseline(s) {unknown}; choose among {', '.join(HF_BASELINES)} ('' for none)")
    args.cfg = bench.BenchConfig(
        shape=dict(bench.TINY if args.tiny else bench.LLAMA_1B),
        batch_sizes=_positive_ints("--batch-sizes", args.batch_sizes),
        context=args.context,
        backends=backends,
        modes=modes,
        hf_baselines=hf,
        iters=args.iters,
        profile=not args.no_profile,
        fuse_linears=not args.no_fuse_linears,
        inductor_config=_inductor_patches("--inductor-config", args.inductor_config),
        compile_sizes=parse_compile_sizes(args.compile_sizes),
        static_inductor_config=_inductor_patches("--static-inductor-config", args.static_inductor_config),
    )
    if not args.tiny and not torch.cuda.is_available():
        logging.getLogger(__name__).warning(
            "bench: no CUDA GPU, so the Llama-3.2-1B shape (1.2 B parameters, float32) runs on the CPU: minutes per "
            "configuration and ~10 GB of memory; --tiny runs a small model instead")


def _unknown_flag_message(sub: argparse.ArgumentParser, unknown: list[str]) -> str:
    """What is wrong with the first of ``unknown`` (arguments ``sub`` did not take): a vLLM flag we know but do not
    take is named with the reason (engine/requests/vllm_names.py), another flag with the closest of ``sub``'s."""
    import difflib

    from compile_attn.engine.requests.vllm_names import REFUSED

    flag = next((u.split("=", 1)[0] for u in unknown if u.startswith("-")), None)
    if flag is None:
        return f"unrecognized arguments: {' '.join(unknown)}"
    name = flag.lstrip("-").replace("-", "_")
    if name in REFUSED:
        return f"{flag} is vLLM's option, not taken here: {REFUSED[name]} (docs/vllm_compat.md)"
    flags = [f for f in sub._option_string_actions if f.startswith("--")]
    close = difflib.get_close_matches(flag, flags, n=3)
    return f"unrecognized argument {flag}" + (f"; did you mean {', '.join(close)}?" if close else "") + \
        f" (`{sub.prog} --help` lists the options)"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # refused by the subcommand, with vLLM's reason or the closest flags (argparse names neither)
        sub = getattr(args, "subparser", parser)
        sub.exit(2, f"{sub.prog}: error: {_unknown_flag_message(sub, unknown)}\n")
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the results' record (run_info)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "prompt", "") is None:
        args.prompt = ["Hello, compile_attn!"]
    prepare = getattr(args, "prepare", None)
    try:
        if prepare is not None:
            try:
                prepare(args)
            except ValueError as exc:  # a bad option value: one line naming it, exit status 2, before any model loads
                args.subparser.exit(2, f"{args.subparser.prog}: error: {exc}\n")
        return args.func(args)
    except (CompileAttnError, FileNotFoundError) as exc:  # the message names the way out: no traceback unless -v
        if args.verbose:
            raise
        print(f"compile-attn {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
