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


# Registered through ``torch.library.Library`` (define + one CompositeExplicitAutograd kernel) rather than
# ``torch.library.custom_op``: the latter wraps every eager call in Python layers (autograd wrapper, the
# per-backend ``backend_impl`` with its aliasing checks) on every call; eager attention runs once per layer
# between piecewise graphs, so that overhead is on the critical path of piecewise and breakable decode steps
# (docs/performance.md).
_LIB = torch.library.Library("compile_attn", "FRAGMENT")  # noqa: TOR901 - kept alive for the process
_LIB.define(
    "attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int layer_id, bool save_kv_cache=True) -> ()"
)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    save_kv_cache: bool = True,
) -> None:
    """Attention of ``q[T, Hq, D]`` over the current batch's KV (plus the new ``k``/``v``) into ``out[T, Hq, Dv]``.

    ``k[T, Hkv, D]`` and ``v[T, Hkv, Dv]`` may be strided views (e.g. slices of a fused q/k/v projection's
    output); every backend stores and reads them as they are (tests/test_strided_kv_views.py)."""
    ctx = get_forward_context()
    layer = ctx.layer(layer_id)
    ctx.backend.forward(q, k, v, layer, ctx.batch, out, save_kv_cache=save_kv_cache)


_LIB.impl("attention", attention, "CompositeExplicitAutograd")


@torch.library.register_fake("compile_attn::attention", lib=_LIB)
def _attention_fake(q, k, v, out, layer_id, save_kv_cache=True) -> None:  # noqa: ANN001
    return None


register_split_op(torch.ops.compile_attn.attention, python_impl=attention)
