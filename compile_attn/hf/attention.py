"""The ``"compile_attn"`` attention and mask functions for transformers' AttentionInterface.

Inside a compile_attn forward context the attention function turns HF's ``[1, H, T, D]`` tensors of a
flattened ragged batch into ``[T, H, D]`` and calls ``torch.ops.compile_attn.attention`` for the
module's layer; the mask function returns None so HF never materialises a 4D mask. Outside a context
both delegate to what a stock HF model of the installed transformers uses (SDPA, or eager where the
model class does not support SDPA, e.g. Gemma2 on recent versions).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch import nn
from transformers import masking_utils
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

from compile_attn.context import get_forward_context, has_forward_context
from compile_attn.errors import InvalidBatchError, UnsupportedConfigError

ATTN_IMPLEMENTATION = "compile_attn"

# (AttentionLayer, scaling, sliding_window, softcap) tuples already checked against the HF call's kwargs.
_verified: set[tuple[Any, ...]] = set()


def _stock_uses_eager(config: Any) -> bool:
    """Whether stock HF (the installed version) defaults to eager attention for this config's model type.

    Stock HF picks SDPA when the model class supports it, else eager; e.g. Gemma2 is eager on recent
    transformers (SDPA cannot softcap) but SDPA on 5.17 and older. (No lru_cache: Dynamo traces this.)
    """
    model_type = getattr(config, "model_type", None)
    name = MODEL_MAPPING_NAMES.get(model_type) if model_type else None
    model_class = getattr(transformers, name, None) if name else None
    return model_class is not None and not getattr(model_class, "_supports_sdpa", True)


def _eager_function(module: nn.Module) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(
            f"{type(module).__name__} has no eager_attention_forward in {type(module).__module__}; "
            f"compile_attn cannot fall back to stock HF attention outside a forward context for this model"
        )
    return fn


def _check_constants(layer_idx: int, kwargs: dict[str, Any], module: nn.Module) -> None:
    """The HF call's scaling/window/softcap must equal the AttentionLayer the op will use (once per layer)."""
    layer = get_forward_context().layer(layer_idx)
    scaling = kwargs.get("scaling")
    scaling = float(module.head_dim) ** -0.5 if scaling is None else float(scaling)
    window = kwargs.get("sliding_window")
    softcap = float(kwargs.get("softcap") or 0.0)
    key = (layer, scaling, window, softcap)
    if key in _verified:
        return
    got = {"scaling": scaling, "sliding_window": window, "logit_cap": softcap}
    for field, value in got.items():
        expected = getattr(layer, field)
        same = abs(value - expected) <= 1e-12 * abs(expected) if field == "scaling" else value == expected
        if not same:
            raise UnsupportedConfigError(
                f"layer {layer_idx}: HF calls attention with {field}={value!r} but the forward context's "
                f"AttentionLayer has {field}={expected!r}; build the backend from "
                f"compile_attn.hf.attention_layers(model) so the constants match"
            )
    _verified.add(key)


def compile_attn_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HF attention function: ``query[B, Hq, S, D]`` etc. -> ``(attn_output[B, S, Hq, Dv], None)``."""
    if not has_forward_context():
        if _stock_uses_eager(getattr(module, "config", None)):
            return _eager_function(module)(module, query, key, value, attention_mask, **kwargs)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)

    batch, num_heads, num_tokens, _ = query.shape
    if batch != 1:
        raise InvalidBatchError(
            f"inside a compile_attn forward context the model takes one flattened ragged batch of "
            f"shape [1, T] (input_ids[None], position_ids[None]); got batch size {batch}"
        )
    if key.shape[2] != num_tokens:
        raise InvalidBatchError(
            f"layer {module.layer_idx}: {key.shape[2]} keys for {num_tokens} queries; the HF KV cache "
            f"must be off inside a compile_attn forward context (call the model with use_cache=False)"
        )
    if kwargs.get("dropout", 0.0) and module.training:
        raise UnsupportedConfigError(
            f"attention dropout {kwargs['dropout']} is not supported by compile_attn; call model.eval()"
        )
    if not torch.compiler.is_compiling():
        batch_tokens = get_forward_context().batch.num_tokens
        if batch_tokens != num_tokens:
            raise InvalidBatchError(
                f"the model got {num_tokens} tokens but the forward context's batch has {batch_tokens}; "
                f"call it with the batch's own input_ids and positions"
            )
        _check_constants(module.layer_idx, kwargs, module)
    # q and k come out of the rotary embedding: under Inductor the copy into [T, H, D] fuses into it. v comes
    # straight from its projection (with fuse_linears, a slice of the fused q/k/v GEMM's output whose token stride
    # is the whole q|k|v row): the backends read and store strided k/v, so it goes in as a view, not a copy.
    # clone, not contiguous(): with one head the rotary output [1, 1, T, D] is already contiguous, and Inductor fails
    # on a view of it as a piece output when T is unbacked (torch 2.13; tests/hf/test_hf_mqa.py pins the cause).
    q = query[0].transpose(0, 1).clone(memory_format=torch.contiguous_format)  # [T, Hq, D]
    k = key[0].transpose(0, 1).clone(memory_format=torch.contiguous_format)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)  # [T, Hkv, Dv]
    out = q.new_empty(num_tokens, num_heads, v.shape[-1])
    torch.ops.compile_attn.attention(q, k, v, out, module.layer_idx)
    return out.unsqueeze(0), None


def compile_attn_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """HF mask function: no mask inside a forward context (the backend masks), stock HF's mask outside."""
    if has_forward_context():
        return None
    if _stock_uses_eager(kwargs.get("config")):
        return masking_utils.eager_mask(*args, **kwargs)
    return masking_utils.sdpa_mask(*args, **kwargs)
