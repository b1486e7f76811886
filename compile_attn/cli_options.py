"""Command-line options that every engine-building subcommand (generate, throughput, serve) shares, and the
EngineConfig they describe: device, attention backend, graph mode, compile switch, the engine's sizes and the
overlap switch, the KV cache dtype and its scales, dtype, seed, tokenizer and revision. vLLM's flag names are taken
too (aliases, docs/vllm_compat.md). Each command keeps its own defaults for the sizes; bad values are refused by flag
name."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from compile_attn.engine.requests.config import EngineConfig

_SIZES = ("max_batch_size", "max_num_tokens", "kv_cache_tokens", "page_size", "max_context", "tensor_parallel_size")


def add_engine_options(p: argparse.ArgumentParser, *, device_help: str, max_batch_size: int, max_num_tokens: int,
                       max_context: int | None = None,
                       max_context_help: str = "tokens per request at most (default: the model's)") -> None:
    """--device, --backend, --graph-mode, --no-compile, --max-batch-size, --max-num-tokens, --kv-cache-tokens,
    --gpu-memory-utilization, --page-size, --max-context, --cascade-decode, --speculative-config, --no-overlap,
    --kv-cache-dtype, --kv-scales-path, --tensor-parallel-size, --dtype, --seed, --tokenizer, --revision: one flag per
    EngineConfig field; vLLM's names (--max-model-len, --max-num-seqs, --max-num-batched-tokens, --block-size,
    --enable-prefix-caching / --no-enable-prefix-caching, -tp) are aliases of ours, and --enforce-eager,
    --trust-remote-code (refused) and --enable-chunked-prefill (always on) take vLLM's meaning (docs/vllm_compat.md)."""
    p.add_argument("--device", default=None, help=device_help)
    p.add_argument("--backend", default="auto",
                   help="attention backend, or '<prefill>+<decode>' (see `compile-attn info`)")
    p.add_argument("--graph-mode", default="full_and_piecewise", help="CUDA graphs (see GraphMode)")
    p.add_argument("--no-compile", action="store_true", help="do not torch.compile the model")
    p.add_argument("--enforce-eager", action="store_true",
                   help="vLLM's flag: eager PyTorch, no CUDA graphs (--graph-mode none --no-compile)")
    p.add_argument("--max-batch-size", "--max-num-seqs", dest="max_batch_size", type=int, default=max_batch_size,
                   help="requests per step at most (vLLM: --max-num-seqs)")
    p.add_argument("--max-num-tokens", "--max-num-batched-tokens", dest="max_num_tokens", type=int,
                   default=max_num_tokens, help="tokens per step at most (vLLM: --max-num-batched-tokens)")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="KV cache capacity (default: the engine's)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU the engine may use; the KV cache gets what weights, activations and "
                        "graphs leave (ignored with --kv-cache-tokens)")
    p.add_argument("--page-size", "--block-size", dest="page_size", type=int, default=1,
                   help="KV cache page size in tokens (vLLM: --block-size)")
    p.add_argument("--max-context", "--max-model-len", dest="max_context", type=int, default=max_context,
                   help=max_context_help + " (vLLM: --max-model-len)")
    p.add_argument("--no-prefix-cache", "--no-enable-prefix-caching", dest="no_prefix_cache", action="store_true",
                   help="do not reuse the KV of prompts that start alike (default: a radix-tree prefix cache; "
                        "`throughput` then also runs its prefix-cache workloads with it off)")
    p.add_argument("--enable-prefix-caching", dest="no_prefix_cache", action="store_false", default=False,
                   help="vLLM's flag: the prefix cache on (the default)")
    p.add_argument("--cascade-decode", choices=("on", "off"), default=None,
                   help="decode batches whose requests share a cached prefix read it once (the triton backend's "
                        "shared-prefix kernels, run between piecewise graphs); default: COMPILE_ATTN_CASCADE_DECODE, "
                        "else off")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding in vLLM's form, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4}' (default: off)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV cache dtype: auto (the model's), fp8_e4m3 (or fp8), fp8_e5m2: one byte per element, "
                        "twice the tokens of a 16-bit cache (docs/fp8_kv.md)")
    p.add_argument("--kv-scales-path", default=None, metavar="JSON",
                   help="fp8 KV scales, {\"k_scale\": [per layer], \"v_scale\": [...]} (default: the checkpoint's, "
                        "else calibrated on the first prefill)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N processes, one per GPU (docs/tensor_parallel.md; default: 1)")
    p.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="vLLM's flag: with --tensor-parallel-size > 1, every all-reduce through NCCL (default: small "
                        "messages through FlashInfer's Lamport all-reduce where every GPU can run it)")
    p.add_argument("--dtype", default="auto",
                   help="weights and activations: auto (bfloat16 on CUDA, float32 on the CPU), bfloat16, float16 / "
                        "half, float32 / float")
    if "--seed" not in p._option_string_actions:  # generate's own --seed seeds its requests (and the engine)
        p.add_argument("--seed", type=int, default=None,
                       help="seed of the requests that bring none, so a run samples the same tokens again "
                            "(default: fresh random seeds; vLLM's default is 0)")
    p.add_argument("--tokenizer", default=None,
                   help="a local directory or Hugging Face model id to read the tokenizer from (default: the model's)")
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hugging Face model id (default: its default branch)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="vLLM's flag, refused: only model code that ships with transformers runs here")
    p.add_argument("--enable-chunked-prefill", action="store_true",
                   help="vLLM's flag, always on here: prefills are chunked by --max-num-tokens")
    p.add_argument("--no-overlap", action="store_true",
                   help="run each step to completion before scheduling the next (default: keep one step in flight)")


def check_engine_options(args: argparse.Namespace) -> None:
    """ValueError naming the flag for a bad backend, graph mode, device, size or memory share."""
    from compile_attn.attention.registry import check_backend_installed, check_backend_name
    from compile_attn.graph_mode import GraphMode

    if args.trust_remote_code:
        from compile_attn.engine.requests.vllm_names import TRUST_REMOTE_CODE

        raise ValueError("--trust-remote-code" + TRUST_REMOTE_CODE.removeprefix("LLM(trust_remote_code=True)")
                         .replace("pass trust_remote_code=False (or leave it out)", "drop the flag"))
    if args.enforce_eager:  # vLLM's flag: --graph-mode none --no-compile
        if args.graph_mode not in ("none", "full_and_piecewise"):
            raise ValueError(f"--enforce-eager runs without CUDA graphs, but --graph-mode is {args.graph_mode!r}; "
                             f"pass one of them")
        args.graph_mode, args.no_compile = "none", True
    check_backend_name(args.backend)
    check_backend_installed(args.backend)  # BackendUnavailableError naming the extra, before any model loads
    GraphMode.parse(args.graph_mode)
    check_device_flag(args.device)
    from compile_attn.engine.requests.config import DTYPE_NAMES

    if args.dtype not in ("auto", *DTYPE_NAMES):
        raise ValueError(f"--dtype must be auto, {', '.join(DTYPE_NAMES)}, got {args.dtype!r}")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be in [0, 2**63), got {args.seed}")
    for name in _SIZES:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    from compile_attn.engine.requests.config import check_kv_cache_dtype

    try:
        kv_cache_dtype = check_kv_cache_dtype(args.kv_cache_dtype)
    except ValueError:
        raise ValueError(f"--kv-cache-dtype must be auto, fp8_e4m3 (or fp8) or fp8_e5m2, got {args.kv_cache_dtype!r}"
                         ) from None
    if args.kv_scales_path is not None and kv_cache_dtype == "auto":
        raise ValueError("--kv-scales-path scales an fp8 KV cache: pass --kv-cache-dtype fp8_e4m3 (or fp8_e5m2) too")
    if args.speculative_config is not None:
        from compile_attn.engine.requests.speculative_config import SpeculativeConfig

        try:
            SpeculativeConfig.parse(args.speculative_config)
        except ValueError as exc:
            raise ValueError(f"--speculative-config: {exc}") from None


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The EngineConfig that the options of ``add_engine_options`` describe; ``overrides`` replace fields (a
    command's own choices, such as the device it picked)."""
    from compile_attn.engine.requests.config import EngineConfig

    options = dict(attn_backend=args.backend, graph_mode=args.graph_mode, compile=not args.no_compile,
                   gpu_memory_utilization=args.gpu_memory_utilization, device=args.device,
                   overlap=not args.no_overlap, enable_prefix_cache=not args.no_prefix_cache,
                   cascade_decode=None if args.cascade_decode is None else args.cascade_decode == "on",
                   speculative_config=args.speculative_config, kv_cache_dtype=args.kv_cache_dtype,
                   kv_scales_path=args.kv_scales_path, dtype=args.dtype, seed=args.seed, tokenizer=args.tokenizer,
                   revision=args.revision, disable_custom_all_reduce=args.disable_custom_all_reduce,
                   **{name: getattr(args, name) for name in _SIZES})
    return EngineConfig(**{**options, **overrides})


def check_device_flag(text: str | None) -> None:
    """``--device``: cpu, or cuda[:N] where torch sees that GPU."""
    if text is None:
        return
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device must be 'cpu', 'cuda' or 'cuda:N', got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be 'cpu', 'cuda' or 'cuda:N', got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {text}: torch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() "
                         f"is False); use --device cpu, or a CUDA build of torch on a machine with a GPU")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {text}: torch sees {torch.cuda.device_count()} CUDA GPU(s), numbered from 0")
