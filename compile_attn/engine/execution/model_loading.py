"""Turn what a user passes to ``LLM`` (HF model, local path, HF config, or a protocol model) into a
model following the engine's protocol, plus its tokenizer, EOS ids, context length and checkpoint directory."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any = None
    eos_token_ids: set[int] = field(default_factory=set)
    max_context: int | None = None
    checkpoint_dir: str | None = None  # the local directory the weights came from (fp8 KV scales are read there)
    kv_heads: tuple[int, int, int] | None = None  # a tensor-parallel rank's KV heads: (first, stop, of the model's)


def _is_protocol_model(model: Any) -> bool:
    return callable(model) and hasattr(model, "attention_layers")


def eos_ids_of(config: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(t) for t in source)
    return ids


def resolve_sources(model: Any, tokenizer: Any, revision: str | None) -> tuple[Any, Any]:
    """``model`` with a path or Hugging Face model id turned into its local directory (compile_attn.hub:
    ModelNotFoundError when neither), and ``tokenizer`` given as a path or model id loaded from its directory (the
    model's revision when it names the model's own repo); objects pass through."""
    from compile_attn.hub import resolve_model, resolve_tokenizer

    name = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
    if name is not None:
        model = resolve_model(name, revision=revision)
    if isinstance(tokenizer, (str, os.PathLike)):
        same_repo = name is not None and os.fspath(tokenizer) == name
        directory = resolve_tokenizer(tokenizer, revision=revision if same_repo else None)
        try:
            from compile_attn.hf.loading import load_tokenizer
        except ImportError as exc:
            raise TypeError(f"LLM(tokenizer={os.fspath(tokenizer)!r}) loads an HF tokenizer, which needs "
                            f"transformers>=5: pip install 'compile-attn[hf]'") from exc
        tokenizer = load_tokenizer(Path(directory))
    return model, tokenizer


def load_for_engine(model: Any, *, tokenizer: Any, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """Protocol models are used as they are; HF models, local directories and configs go through
    ``compile_attn.hf`` (which needs transformers), which creates or loads the weights on ``device`` directly."""
    if _is_protocol_model(model) and not hasattr(model, "model"):
        return LoadedModel(model.to(device=device, dtype=dtype).eval(), tokenizer)
    try:
        from transformers import PretrainedConfig, PreTrainedModel

        from compile_attn.hf import HFModelAdapter, load_model
    except ImportError as exc:
        raise TypeError(
            f"LLM(model=...) got {type(model).__name__}: HF models need transformers>=5 "
            f"(pip install 'compile-attn[hf]'), or pass a module with attention_layers() and forward(input_ids, positions)"
        ) from exc
    if isinstance(model, HFModelAdapter):
        adapter = model
    elif isinstance(model, PreTrainedModel):
        adapter = HFModelAdapter(model)
    elif isinstance(model, (str, os.PathLike, PretrainedConfig)):
        start = time.perf_counter()
        adapter = load_model(model, dtype=dtype, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the time of the initialisation kernels, not of their launches
        logger.info("%s %s on %s in %.2f s", "initialised" if isinstance(model, PretrainedConfig) else "loaded",
                    type(adapter.model).__name__, device, time.perf_counter() - start)
    else:
        raise TypeError(
            f"LLM(model=...) got {type(model).__name__}; pass an HF model, a local HF directory, a transformers "
            f"config, or a module with attention_layers() and forward(input_ids, positions)"
        )
    adapter = adapter.to(device=device, dtype=dtype).eval()
    tok = tokenizer if tokenizer is not None else adapter.tokenizer
    config = adapter.config
    max_context = getattr(config, "max_position_embeddings", None)
    return LoadedModel(adapter, tok, eos_ids_of(config, tok), max_context, _local_dir(model, config))


def _local_dir(model: Any, config: Any) -> str | None:
    """The local checkpoint directory: ``model`` when it is one, else the config's ``_name_or_path`` when that is."""
    for candidate in (model, getattr(config, "_name_or_path", None)):
        if isinstance(candidate, (str, os.PathLike)) and os.path.isdir(candidate):
            return os.fspath(candidate)
    return None
