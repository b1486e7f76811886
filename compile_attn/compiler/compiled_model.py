"""CompiledModel: ``torch.compile(model, backend="compile_attn")`` for models that follow the model protocol,
with the token dimension marked unbacked so that no token count (1 included) ever recompiles.

Dynamo specializes sizes 0 and 1 of ordinary dynamic dimensions, so a batch of one decode token would
compile a second, static graph. An unbacked size has no such special cases: one graph serves every
token count. The attention op and the compile backend are unchanged by this; it only decides how the
inputs are marked.

Each CompiledModel compiles its own code. Dynamo keeps compiled code per Python code object and reuses an entry
whose guards pass, and every model of one class runs the same ``forward`` code: a second model of the same
architecture in the process (another engine, another checkpoint) would otherwise run the first one's compiled
graph, with the fused weights and CUDA graphs it holds (wrong tokens, and graphs replayed with another engine's
buffers). The model is called through a function whose code object belongs to this CompiledModel alone, so its
compiled entries are its own, and they are dropped when it is.
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections.abc import Callable
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
        entry = _own_entry(model)
        self.compiled = torch.compile(entry, backend="compile_attn", dynamic=False, options=options or {})
        # Dynamo keeps compiled entries with the code they were compiled for, beyond this object's life (the code
        # stays referenced from Dynamo's own maps): drop them when this model goes, and with them the fused
        # weights and CUDA graphs they hold.
        weakref.finalize(self, torch._dynamo.reset_code, entry.__code__)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # A view into a larger upload (ForwardBatch.build sends a step's ints in one copy) has a storage offset,
        # which Dynamo would guard on (0/1-specialised) or make a second symbol of: a recompile, and pieces
        # with two dynamic sizes get no piecewise graphs. Graph steps pass static buffers at offset 0 and take
        # no copy; eager steps copy their ids/positions (a few KB).
        input_ids, positions = _at_offset_zero(input_ids), _at_offset_zero(positions)
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


_ENTRY_IDS = itertools.count()


def _own_entry(model: nn.Module) -> Callable[..., Any]:
    """``model(*args, **kwargs)`` through a function with a code object of its own (a copy under a new name), the
    frame Dynamo compiles; the model's own code is inlined into it."""

    def call_model(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)

    code = call_model.__code__.replace(co_name=f"compiled_model_{next(_ENTRY_IDS)}")
    return types.FunctionType(code, call_model.__globals__, code.co_name, None, call_model.__closure__)


def _at_offset_zero(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy of it at storage offset 0 of the same kind (an inference tensor stays one, a normal
    tensor stays normal: Dynamo guards on that too)."""
    if not x.storage_offset():
        return x
    with torch.inference_mode(x.is_inference()):
        return x.clone()


def compile_model(model: nn.Module, options: dict[str, Any] | None = None) -> CompiledModel:
    """Compile ``model`` with ``backend="compile_attn"`` and one graph for every token count."""
    return CompiledModel(model, options)
