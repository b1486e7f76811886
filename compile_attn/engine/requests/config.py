"""EngineConfig: every option of ``LLM(...)`` in one dataclass, checked once in ``__post_init__`` before a model
loads, so a bad value is refused by name in one line instead of failing deep inside loading or the first step.

``LLM(model, **options)`` filters its keywords through ``EngineConfig``'s fields (``LLM(model, config=...)`` takes
one whole); the command line builds the same object (``cli_options.engine_config``). This module checks and
normalises values; it builds nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from compile_attn.attention.registry import check_backend_installed, check_backend_name
from compile_attn.config import GraphConfig
from compile_attn.engine.requests.errors import EngineOptionError, UnknownEngineOptionError
from compile_attn.engine.requests.speculative_config import SpeculativeConfig
from compile_attn.engine.requests.vllm_names import translate, unknown_option_message
from compile_attn.errors import InvalidConfigError
from compile_attn.graph_mode import GraphMode

# vLLM's dtype names; "auto" (or None) is bfloat16 on CUDA and float32 on the CPU.
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
               "float32": torch.float32, "float": torch.float32}
# KV cache dtypes by name ("auto": the model's dtype); "fp8" is e4m3, as in vLLM.
KV_CACHE_DTYPE_NAMES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class EngineConfig:
    """The engine's options. After ``__post_init__``, ``device`` is a ``torch.device`` and ``dtype`` a floating
    ``torch.dtype``; the other fields are as given.

    attn_backend: a backend name, ``"auto"`` or ``"<prefill>+<decode>"`` (see ``create_backend``).
    graph_mode: which CUDA graphs run (see GraphMode; on the CPU the same logic runs eagerly).
    compile: wrap the model in ``torch.compile(backend="compile_attn")``; compile_options: GraphConfig fields.
    capture: capture every graph and warm up every step shape at start-up (off: lazily, for tests).
    max_batch_size: requests per step, and request rows of the KV cache; max_num_tokens: tokens per step.
    kv_cache_tokens: the KV capacity; None sizes it from ``gpu_memory_utilization`` of the device's memory (CUDA)
    or as ``max_batch_size * max_context`` capped by host memory (CPU), see engine/execution/kv_sizing.py.
    max_context: tokens per request at most (None: the model's, else 4096). page_size: tokens per KV page.
    dtype: a floating torch.dtype or one of vLLM's names ("auto" / None: bfloat16 on CUDA, float32 on the CPU).
    device: "cpu", "cuda" or "cuda:N" (None: CUDA when there is one).
    overlap: keep one step in flight (the host schedules step N+1 while the device runs step N).
    enable_prefix_cache: keep computed KV in a radix tree so that prompts starting alike reuse it.
    cascade_decode: give decode batches their shared-prefix groups (requests reading the same cached prefix pages,
    ``shared_prefix.MIN_REQUESTS`` or more sharing ``MIN_TOKENS`` tokens or more), so that a backend with a
    shared-prefix decode path (triton) reads each shared prefix once; such batches run through the piecewise graphs
    instead of a full decode graph. None: on when ``COMPILE_ATTN_CASCADE_DECODE=1``, else off.
    speculative_config: speculative decoding in vLLM's form, e.g. ``{"method": "ngram", "num_speculative_tokens":
    4}`` (a dict, its JSON text or a SpeculativeConfig; None: off). See engine/requests/speculative_config.py.
    kv_cache_dtype: "auto" (the model's dtype), "fp8_e4m3" (or "fp8"), "fp8_e5m2", or the torch fp8 dtype; after
    ``__post_init__`` one of "auto", "fp8_e4m3", "fp8_e5m2" (``kv_dtype`` is the torch dtype). An fp8 cache stores
    one byte per element, with per-layer, per-KV-head scales (docs/fp8_kv.md).
    kv_scales_path: a JSON file of fp8 KV scales (kv/kv_scales.py); None: the checkpoint's, else the first
    prefill's.
    tensor_parallel_size: processes (one per GPU) that split every layer of an HF model (docs/tensor_parallel.md);
    the engine starts and stops the other ranks' workers itself.
    disable_custom_all_reduce: with tensor parallelism on GPUs, sum every message through NCCL (vLLM's name); by
    default messages of up to 2,048 tokens go through FlashInfer's Lamport all-reduce where every rank can run it
    (distributed/lamport_all_reduce.py).
    seed: requests without a ``SamplingParams.seed`` draw their sampling seeds from a generator seeded with this, so
    a script that makes the same calls samples the same tokens on every run (None: fresh random seeds each run;
    vLLM's default is 0).
    tokenizer: a local directory or a Hugging Face model id to read the tokenizer from (None: the model's own).
    revision: the branch, tag or commit of a Hugging Face model id (None: its default branch).

    ``LLM(...)`` also takes vLLM's names (``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``block_size``, ``enable_prefix_caching``, ``enforce_eager``, ``trust_remote_code=False``): see
    engine/requests/vllm_names.py and docs/vllm_compat.md.
    """

    attn_backend: str = "auto"
    graph_mode: str | GraphMode = "full_and_piecewise"
    compile: bool = True
    compile_options: Mapping[str, Any] | None = None
    capture: bool = True
    max_batch_size: int = 32
    max_num_tokens: int = 2048
    kv_cache_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    max_context: int | None = None
    page_size: int = 1
    dtype: str | torch.dtype | None = None
    device: str | torch.device | None = None
    overlap: bool = True
    enable_prefix_cache: bool = True
    cascade_decode: bool | None = None
    speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = None
    kv_cache_dtype: str | torch.dtype = "auto"
    kv_scales_path: str | None = None
    tensor_parallel_size: int = 1
    disable_custom_all_reduce: bool = False
    seed: int | None = None
    tokenizer: str | None = None
    revision: str | None = None

    def __post_init__(self) -> None:
        check_backend_name(self.attn_backend)  # a misspelt name or mode fails here, not after the model has loaded
        check_backend_installed(self.attn_backend)  # so does a backend whose kernel package is missing
        GraphConfig.from_options({**(self.compile_options or {}), "mode": self.graph_mode})
        check_memory_utilization(self.gpu_memory_utilization)
        check_sizes(max_batch_size=self.max_batch_size, max_num_tokens=self.max_num_tokens, page_size=self.page_size,
                    max_context=self.max_context, kv_cache_tokens=self.kv_cache_tokens)
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        device = check_device(self.device)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "dtype", check_dtype(self.dtype, device))
        object.__setattr__(self, "kv_cache_dtype", check_kv_cache_dtype(self.kv_cache_dtype))
        if self.kv_scales_path is not None and self.kv_cache_dtype == "auto":
            raise EngineOptionError(f"LLM(kv_scales_path={self.kv_scales_path!r}) scales an fp8 KV cache, but "
                                    f"kv_cache_dtype is 'auto'; pass kv_cache_dtype='fp8_e4m3', or drop kv_scales_path")
        check_tensor_parallel(self)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise EngineOptionError(f"LLM(seed=...) must be an int in [0, 2**63) or None, got {self.seed!r}")
        for name in ("tokenizer", "revision"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise EngineOptionError(f"LLM({name}=...) must be a non-empty string or None, got {value!r}")

    @classmethod
    def from_options(cls, config: EngineConfig | None = None, **options: Any) -> EngineConfig:
        """``config`` (default: every field's default) with ``options`` replacing its fields. vLLM's names are taken
        too (vllm_names.translate); a keyword that is neither is refused with the closest names of either."""
        names = [f.name for f in dataclasses.fields(cls)]
        options = translate(options)  # vLLM's names -> ours (a refused one raises with its reason)
        unknown = [k for k in options if k not in names]
        if unknown:
            raise UnknownEngineOptionError(unknown_option_message(unknown[0], names))
        return dataclasses.replace(config, **options) if config is not None else cls(**options)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's torch dtype: the model's for "auto", else the fp8 format named."""
        return self.dtype if self.kv_cache_dtype == "auto" else KV_CACHE_DTYPE_NAMES[self.kv_cache_dtype]

    @property
    def uses_graphs(self) -> bool:
        """Whether any CUDA graph is captured (graph_mode other than "none")."""
        return GraphMode.parse(self.graph_mode) is not GraphMode.NONE


def check_sizes(**sizes: int | None) -> None:
    """Each size a positive int (None: its default), refused by name."""
    for name, value in sizes.items():
        if value is None and name in ("max_context", "kv_cache_tokens"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise EngineOptionError(f"LLM({name}=...) must be a positive int, got {value!r}")


def check_memory_utilization(utilization: float) -> None:
    """InvalidConfigError unless ``0 < utilization <= 1`` (a float: the share of device memory the engine uses)."""
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
        raise InvalidConfigError(
            f"gpu_memory_utilization must be a number in (0, 1], the share of the device's memory the engine may "
            f"use, got {utilization!r}; e.g. 0.9, or pass kv_cache_tokens to size the KV cache yourself"
        )


def check_device(device: str | torch.device | None) -> torch.device:
    """The engine's device: CUDA when present unless named; a CUDA device without CUDA is refused in one line."""
    try:
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError) as exc:
        raise EngineOptionError(f"LLM(device={device!r}) is not a device ({exc}); pass 'cpu', 'cuda' or "
                                f"'cuda:N'") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise EngineOptionError(f"LLM(device={str(device)!r}) but CUDA is not available here (torch "
                                    f"{torch.__version__}); pass device='cpu', or install a CUDA build of torch")
        if device.index is not None and device.index >= count:
            raise EngineOptionError(f"LLM(device={str(device)!r}) but only {count} CUDA device(s) exist; "
                                    f"pass device='cuda:0'..'cuda:{count - 1}'")
    return device


def check_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The weights' and KV cache's dtype from a torch floating dtype or one of vLLM's names ("auto", "bfloat16",
    "float16" / "half", "float32" / "float"); "auto" and None pick bfloat16 on CUDA, float32 on the CPU."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise EngineOptionError(f"LLM(dtype={dtype!r}) is not a floating dtype; pass 'auto' (bfloat16 on CUDA, float32 "
                            f"on the CPU), {', '.join(map(repr, DTYPE_NAMES))}, or a floating torch.dtype")


def check_kv_cache_dtype(kv_cache_dtype: str | torch.dtype | None) -> str:
    """The KV cache dtype's canonical name ("auto", "fp8_e4m3", "fp8_e5m2") from a name (vLLM's: "fp8" is e4m3) or
    a torch fp8 dtype; anything else is refused by name."""
    if kv_cache_dtype is None or kv_cache_dtype == "auto":
        return "auto"
    for name, dtype in KV_CACHE_DTYPE_NAMES.items():
        if kv_cache_dtype == name or kv_cache_dtype is dtype:
            return "fp8_e4m3" if dtype is torch.float8_e4m3fn else name
    raise EngineOptionError(
        f"LLM(kv_cache_dtype={kv_cache_dtype!r}) is not a KV cache dtype; pass 'auto' (the model's dtype), "
        f"'fp8_e4m3' (or 'fp8'), or 'fp8_e5m2'"
    )


def check_tensor_parallel(config: EngineConfig) -> None:
    """``tensor_parallel_size`` a positive int, at most the CUDA devices on a GPU, and not combined with what tensor
    parallelism does not support yet (speculative trees, cascade decode); refused by name. Whether
    the model's heads split is checked when it loads (``distributed.plan_for``)."""
    size = config.tensor_parallel_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise EngineOptionError(f"LLM(tensor_parallel_size=...) must be a positive int, got {size!r}")
    if size == 1:
        return
    if config.device.type == "cuda" and size > torch.cuda.device_count():
        raise EngineOptionError(f"LLM(tensor_parallel_size={size}) needs one GPU per rank, but {torch.cuda.device_count()} "
                                f"CUDA device(s) exist; pass tensor_parallel_size <= {torch.cuda.device_count()}")
    if config.device.type == "cuda" and config.device.index not in (None, 0):
        raise EngineOptionError(f"LLM(tensor_parallel_size={size}) puts rank r on cuda:r; pass device='cuda', not "
                                f"{str(config.device)!r} (set CUDA_VISIBLE_DEVICES to choose the GPUs)")
    spec = config.speculative_config
    unsupported = [("speculative_config", spec is not None and spec.topk > 1),  # trees: their KV moves stay on rank 0
                   ("cascade_decode", config.cascade_decode is True)]
    for name, used in unsupported:
        if used:
            raise EngineOptionError(f"LLM({name}=...) does not work with tensor_parallel_size={size} yet (see "
                                    f"docs/tensor_parallel.md); leave {name} at its default, or use "
                                    f"tensor_parallel_size=1")
