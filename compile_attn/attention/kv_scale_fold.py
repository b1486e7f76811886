"""Per-KV-head fp8 scales folded around a kernel that reads the fp8 pool unscaled (flashinfer).

With ``k_real = k_stored * ks[h]`` and ``v_real = v_stored * vs[h]`` for KV head ``h``, attention over the real
values equals attention over the stored ones with each query head of group ``h`` multiplied by ``ks[h]`` first
(``q . k_real = (q * ks) . k_stored``: the same scores, so the same softmax, windows and soft caps) and the output
multiplied by ``vs[h]`` after (the weights sum to one per row). Both are tensor ops on the scale tensors, so graphs
captured before the scales were set read their current values. No kernel here: backends call these around theirs.
"""

from __future__ import annotations

import torch

from compile_attn.kv.fp8 import dequantize, quantize


def fold_k_scale(q: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """``q[T, Hq, D]`` with query head ``i`` multiplied by ``k_scale[i // (Hq // Hkv)]``, in ``q``'s dtype."""
    hkv = k_scale.shape[0]
    return (q.unflatten(1, (hkv, -1)) * k_scale[:, None, None]).flatten(1, 2).to(q.dtype)


def apply_v_scale_(out: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Multiply ``out[T, Hq, Dv]`` in place by ``v_scale`` of each query head's KV head."""
    out.unflatten(1, (v_scale.shape[0], -1)).mul_(v_scale[:, None, None])


def as_stored(x: torch.Tensor, scale: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """``x[T, Hkv, D]`` as an fp8 pool of ``kv_dtype`` holds it (quantised and back), in ``x``'s dtype: what a
    kernel that takes the step's new K/V from its inputs must see to match one that reads them from the pool."""
    return dequantize(quantize(x, scale, kv_dtype), scale).to(x.dtype)
