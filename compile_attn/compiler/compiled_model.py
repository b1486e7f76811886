"""CompiledModel: ``torch.compile(model, backend="compile_attn")`` for models that follow the model protocol,
with the token dimension marked unbacked so that no token count (1 included) ever recompiles.

Dynamo specializes sizes 0 and 1 of ordinary dynamic dimensions, so a batch of one decode token would
compile a second, static graph. An unbacked size has no such special cases: one graph serves every
token count. The attention op and the compile backend are unchanged by this; it only decides how the
inputs are marked.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._dynamo.decorators import mark_unbacked


class CompiledModel(nn.Module):
    """``model(input_ids[T], positions[T], *rest)`` compiled with the compile_attn backend."""

    def __init__(self, model: nn.Module, options: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.model = model
        self.options = dict(options or {})
        self.compiled = torch.compile(model, backend="compile_attn", dynamic=False, options=options or {})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        mark_unbacked(input_ids, 0)
        mark_unbacked(positions, 0)
        return self.compiled(input_ids, positions, *args, **kwargs)

    def attention_layers(self) -> list:
        return self.model.attention_layers()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)  # tokenizer, config, ... of the wrapped model


def compile_model(model: nn.Module, options: dict[str, Any] | None = None) -> CompiledModel:
    """Compile ``model`` with ``backend="compile_attn"`` and one graph for every token count."""
    return CompiledModel(model, options)
