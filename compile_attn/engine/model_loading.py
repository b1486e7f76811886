"""Turn what a user passes to ``LLM`` (HF model, local path, HF config, or a protocol model) into a
model following the engine's protocol, plus its tokenizer, EOS ids and context length."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any = None
    eos_token_ids: set[int] = field(default_factory=set)
    max_context: int | None = None


def _is_protocol_model(model: Any) -> bool:
    return callable(model) and hasattr(model, "attention_layers")


def load_for_engine(model: Any, *, tokenizer: Any, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    if _is_protocol_model(model):
        return LoadedModel(model.to(device=device, dtype=dtype).eval(), tokenizer)
    raise TypeError(
        f"LLM(model=...) got {type(model).__name__}; pass an HF model, a local HF directory, a transformers "
        f"config, or a module with attention_layers() and forward(input_ids, positions)"
    )
