"""vLLM's option names on ``LLM(...)``: the keywords we take under vLLM's name (aliases of our fields), those taken
with vLLM's meaning though we have no field of that name (``enforce_eager``, ``trust_remote_code=False``), and those
we know but do not take, each with the reason and the way out. The "did you mean" hints of an unknown keyword come
from this table first, then from string similarity over every name we take. docs/vllm_compat.md is the same table
for people; a test checks that the two agree.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from compile_attn.engine.requests.errors import EngineOptionError, UnknownEngineOptionError

# vLLM's keyword -> our EngineConfig field of the same meaning.
ALIASES = {
    "max_model_len": "max_context",  # tokens per request at most, prompt and output together
    "max_num_seqs": "max_batch_size",  # requests (sequences) per step
    "max_num_batched_tokens": "max_num_tokens",  # tokens per step
    "block_size": "page_size",  # tokens per KV cache block (page)
    "enable_prefix_caching": "enable_prefix_cache",  # reuse the KV of prompts that start alike
}

# vLLM keywords whose value we take with vLLM's meaning but that are no field of ours: name -> what they set.
TRANSLATED = ("enforce_eager", "trust_remote_code", "enable_chunked_prefill")

ENFORCE_EAGER = {"graph_mode": "none", "compile": False}  # enforce_eager=True: eager PyTorch, no CUDA graphs

TRUST_REMOTE_CODE = (
    "LLM(trust_remote_code=True) is refused: compile_attn runs only the model code that ships with transformers "
    "(its supported families: Llama, Qwen2, Qwen3, Mistral, Gemma2, Gemma3), never a checkpoint's own Python files, "
    "so there is no remote code to trust; pass trust_remote_code=False (or leave it out)"
)

CHUNKED_PREFILL = ("LLM(enable_chunked_prefill=False) is refused: prefills are always chunked, by max_num_tokens "
                   "(vLLM's max_num_batched_tokens) tokens per step; pass True or leave it out")

# vLLM keywords we know and do not take: name -> why, and what to do instead.
REFUSED = {
    "quantization": "quantized weights (AWQ, GPTQ, fp8 weights) are not supported; the KV cache can be 8-bit: "
                    "kv_cache_dtype='fp8'",
    "pipeline_parallel_size": "there is no pipeline parallelism; tensor_parallel_size splits every layer over GPUs",
    "data_parallel_size": "there is no data parallelism inside one LLM; start one LLM (or server) per GPU",
    "swap_space": "preempted requests are recomputed, never swapped to host memory: drop it",
    "cpu_offload_gb": "weights are never offloaded to host memory: drop it",
    "tokenizer_mode": "the fast (tokenizers) tokenizer of the checkpoint is always used: drop it",
    "tokenizer_revision": "the tokenizer is read at revision when it is the model's own, else at its default "
                          "branch: drop it, or pass a local directory as tokenizer",
    "load_format": "checkpoints load from safetensors files: drop it",
    "download_dir": "models download into the Hugging Face cache: set HF_HUB_CACHE (or HF_HOME) instead",
    "compilation_config": "torch.compile is configured by compile (on / off), graph_mode (which CUDA graphs) and "
                          "compile_options (GraphConfig's fields, docs/compile_backend.md)",
    "max_seq_len_to_capture": "CUDA graphs cover every context length (attention reads the KV cache through "
                              "static metadata): drop it",
    "num_gpu_blocks_override": "the KV cache's size is kv_cache_tokens, in tokens (blocks x block_size)",
    "calculate_kv_scales": "an fp8 KV cache takes the checkpoint's scales, else kv_scales_path, else calibrates on "
                           "the first prefill (docs/fp8_kv.md): drop it",
    "distributed_executor_backend": "tensor parallelism always runs one worker process per extra GPU "
                                    "(torch.multiprocessing): drop it",
    "skip_tokenizer_init": "prompts may be token ids whatever the tokenizer; without a tokenizer, pass a module "
                           "model or a directory without tokenizer files",
    "served_model_name": "is the server's option: compile-attn serve --served-model-name",
}


def vllm_names() -> set[str]:
    """Every vLLM keyword this table knows: aliases, translated keywords and refused ones."""
    return set(ALIASES) | set(TRANSLATED) | set(REFUSED)


def translate(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with vLLM's keywords turned into ours: aliases renamed, ``enforce_eager=True`` as graph_mode
    "none" and compile off, ``trust_remote_code=False`` and ``enable_chunked_prefill=True`` dropped (the other value
    refused). A refused vLLM keyword raises
    UnknownEngineOptionError with its reason; an alias given next to our own name for the same field raises
    EngineOptionError. Names neither ours nor vLLM's pass through unchanged (EngineConfig.from_options refuses them
    with hints)."""
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # our field -> the keyword that set it (``name=value`` as written)
    for name, value in options.items():
        if name in REFUSED:
            raise UnknownEngineOptionError(f"LLM({name}=...) is vLLM's option, not taken here: {REFUSED[name]} "
                                           f"(docs/vllm_compat.md)")
        if name == "trust_remote_code":
            if value:
                raise EngineOptionError(TRUST_REMOTE_CODE)
            continue
        if name == "enable_chunked_prefill":  # always on
            if not value:
                raise EngineOptionError(CHUNKED_PREFILL)
            continue
        if name == "enforce_eager":
            if not isinstance(value, bool):
                raise EngineOptionError(f"LLM(enforce_eager=...) must be True or False, got {value!r}")
            if value:
                for field, eager in ENFORCE_EAGER.items():
                    _set(out, given, field, eager, "enforce_eager=True")
            continue
        _set(out, given, ALIASES.get(name, name), value, f"{name}={value!r}")
    return out


def _set(out: dict[str, Any], given: dict[str, str], field: str, value: Any, source: str) -> None:
    if field in out and out[field] != value:
        if any(s.startswith("enforce_eager") for s in (source, given[field])):
            why = "enforce_eager=True means " + ", ".join(f"{k}={v!r}" for k, v in ENFORCE_EAGER.items())
        else:
            why = f"vLLM's {', '.join(n for n, f in ALIASES.items() if f == field)} is our {field}"
        raise EngineOptionError(f"LLM() got {given[field]} and {source}, which set {field} differently ({why}); "
                                f"pass one of them")
    out[field] = value
    given[field] = source


def unknown_option_message(name: str, fields: Iterable[str]) -> str:
    """The message for a keyword that is neither one of ``fields`` nor a vLLM name we know: the closest of our names
    and of vLLM's names we take (each alias shown with the field it sets)."""
    fields = list(fields)
    takes = {**{f: f for f in fields}, **ALIASES, **{t: t for t in TRANSLATED}}
    close = difflib.get_close_matches(name, list(takes), n=3, cutoff=0.7) or \
        difflib.get_close_matches(name, list(takes), n=3)
    shown = [f"{c} (vLLM's name for {takes[c]})" if takes[c] != c else c for c in close]
    hint = f"did you mean {', '.join(shown)}? " if shown else ""
    return (f"LLM() got an unknown option {name!r}; {hint}the options are EngineConfig's fields: {', '.join(fields)}; "
            f"vLLM's names {', '.join(sorted(ALIASES))} are taken too (docs/vllm_compat.md)")
