"""The KV cache's two device stores: the request table (``req_to_token``) and the per-layer paged K/V pool.

Row ``PAD_REQUEST`` of the table and page 0 of the pool (slot ``PAD_SLOT``) are scratch: padding reads and writes
there. These classes hold tensors and free rows only; which pages a request holds is ``KVCache``'s bookkeeping
(``kv/cache.py``), and they know nothing of batches or backends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from compile_attn.arg_checks import kv_dtype, positive_int
from compile_attn.batch import PAD_REQUEST, PAD_SLOT
from compile_attn.errors import KVCacheExhaustedError
from compile_attn.host_tensors import to_device
from compile_attn.kv.fp8 import is_fp8, quantize


class ReqToTokenPool:
    """``req_to_token[row, position] -> slot`` for up to ``max_batch_size`` live requests (+1 scratch row)."""

    def __init__(self, max_batch_size: int, max_context: int, device: torch.device | str = "cpu") -> None:
        max_batch_size = positive_int("ReqToTokenPool", "max_batch_size", max_batch_size)
        max_context = positive_int("ReqToTokenPool", "max_context", max_context)
        self.max_batch_size = max_batch_size
        self.max_context = max_context
        self.num_rows = max_batch_size + 1
        self.req_to_token = torch.full((self.num_rows, max_context), PAD_SLOT, dtype=torch.int32, device=device)
        self._free_rows = list(range(self.num_rows - 1, 0, -1))  # stack; row 0 is scratch

    @property
    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self, n: int = 1) -> list[int]:
        if n > len(self._free_rows):
            raise KVCacheExhaustedError(
                f"request table full: asked for {n} rows, {len(self._free_rows)} free of {self.max_batch_size}; "
                f"finish or preempt requests, or raise max_batch_size"
            )
        return [self._free_rows.pop() for _ in range(n)]

    def free(self, rows: Sequence[int]) -> None:
        """Return ``rows`` and reset their entries to the scratch slot: one device op for any number of rows."""
        free = set(self._free_rows)
        if len(set(rows)) != len(rows):
            raise ValueError(f"cannot free request rows {list(rows)}: a row appears twice")
        for r in rows:
            if r == PAD_REQUEST or not 0 < r < self.num_rows or r in free:
                raise ValueError(f"cannot free request row {r}: it is not an allocated row")
        if len(rows) == 1:
            self.req_to_token[rows[0]].fill_(PAD_SLOT)
        elif rows:
            (index,) = to_device([rows], torch.int64, self.req_to_token.device)
            self.req_to_token.index_fill_(0, index, PAD_SLOT)
        self._free_rows.extend(rows)


class PagedKVPool:
    """Per-layer K and V buffers ``[num_slots, num_kv_heads, head_dim]``; page 0 is the scratch page. An fp8 pool
    also holds per-layer, per-KV-head float32 scales for K and V (``kv_scales``; see ``kv/fp8.py``), updated in
    place so that captured graphs read their current values. Until a layer's scales are set (``kv_scales.
    apply_scales``) the first prefill through a backend sets them (``scale_calibration``, which ``KVCache`` attaches;
    None once all are set). Where the scales come from is ``kv/kv_scales.py``'s, not the pool's."""

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None = None,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
    ) -> None:
        owner = "PagedKVPool"
        self.num_pages = num_pages = positive_int(owner, "num_pages", num_pages)
        self.page_size = page_size = positive_int(owner, "page_size", page_size)
        self.num_layers = num_layers = positive_int(owner, "num_layers", num_layers)
        self.num_kv_heads = num_kv_heads = positive_int(owner, "num_kv_heads", num_kv_heads)
        self.head_dim = head_dim = positive_int(owner, "head_dim", head_dim)
        self.v_head_dim = head_dim if v_head_dim is None else positive_int(owner, "v_head_dim", v_head_dim)
        self.dtype = dtype = kv_dtype(owner, dtype)
        self.device = torch.device(device)
        self.num_slots = (num_pages + 1) * page_size
        self.k_buffers = [
            torch.zeros(self.num_slots, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        self.v_buffers = [
            torch.zeros(self.num_slots, num_kv_heads, self.v_head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.quantized = is_fp8(dtype)
        self.k_scales = [torch.ones(num_kv_heads, dtype=torch.float32, device=device) for _ in range(num_layers)]
        self.v_scales = [torch.ones(num_kv_heads, dtype=torch.float32, device=device) for _ in range(num_layers)]
        self.scale_calibration: Any = None  # a kv_scales.FirstPrefillCalibration while an fp8 layer has no scales

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def kv_scales(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An fp8 pool's ``(k_scale[Hkv], v_scale[Hkv])`` float32 tensors for a layer (stored = real / scale);
        None for an unquantised pool."""
        return (self.k_scales[layer_id], self.v_scales[layer_id]) if self.quantized else None

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k[T, Hkv, D]``, ``v[T, Hkv, Dv]`` at slots ``loc[T]`` (graph-capturable); an fp8 pool stores them
        divided by the layer's scales, saturated."""
        if self.quantized:  # written as bytes: index_copy_ has no fp8 kernel on every device
            k_buf, v_buf = self.k_buffers[layer_id].view(torch.uint8), self.v_buffers[layer_id].view(torch.uint8)
            k_buf.index_copy_(0, loc, quantize(k, self.k_scales[layer_id], self.dtype).view(torch.uint8))
            v_buf.index_copy_(0, loc, quantize(v, self.v_scales[layer_id], self.dtype).view(torch.uint8))
            return
        self.k_buffers[layer_id].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffers[layer_id].index_copy_(0, loc, v.to(self.dtype))

    @property
    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (*self.k_buffers, *self.v_buffers))
