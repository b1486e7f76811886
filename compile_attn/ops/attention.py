"""``torch.ops.compile_attn.attention``: the attention custom op and its fake implementation.

Out-variant: the caller allocates ``out`` and the op mutates only ``out`` (plus, as a side effect
outside the op's arguments, the KV pool when ``save_kv_cache``). Everything per-step (batch,
backend, KV cache) comes from the forward context, so a graph can replay the op with its
capture-time arguments.
"""

from __future__ import annotations

import torch

from compile_attn.context import get_forward_context
from compile_attn.ops.split_registry import register_split_op


@torch.library.custom_op("compile_attn::attention", mutates_args=("out",))
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    save_kv_cache: bool = True,
) -> None:
    """Attention of ``q[T, Hq, D]`` over the current batch's KV (plus the new ``k``/``v``) into ``out[T, Hq, Dv]``."""
    ctx = get_forward_context()
    layer = ctx.layer(layer_id)
    ctx.backend.forward(q, k, v, layer, ctx.batch, out, save_kv_cache=save_kv_cache)


@attention.register_fake
def _attention_fake(q, k, v, out, layer_id, save_kv_cache=True) -> None:  # noqa: ANN001
    return None


register_split_op(torch.ops.compile_attn.attention)
