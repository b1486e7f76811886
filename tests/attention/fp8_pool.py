"""What an attention reference reads from an fp8 KV pool (``kv/fp8.py``): the pool's bytes dequantised with a
layer's scales, and new K/V rounded through the format as a store leaves them. The fp8 backend tests compare
against references built on these."""

from __future__ import annotations

import torch

from compile_attn import KVCache
from compile_attn.kv.fp8 import dequantize, quantize


def dequantized_pool(kv: KVCache, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer_id``'s K and V pools as the values they stand for (bytes times the layer's scales)."""
    k_pool, v_pool = kv.pool.get_kv(layer_id)
    k_scale, v_scale = kv.pool.kv_scales(layer_id)
    return dequantize(k_pool, k_scale), dequantize(v_pool, v_scale)


def as_stored(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a read of it after an fp8 store gives it back: quantised with ``scale``, then dequantised."""
    return dequantize(quantize(x, scale, dtype), scale)
