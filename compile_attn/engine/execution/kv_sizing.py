"""How many KV tokens the engine allocates when ``kv_cache_tokens`` is not given: pure arithmetic on memory
figures measured elsewhere (``memory_profile``), so the formulas can be checked with numbers by hand.

On CUDA the cache gets what ``gpu_memory_utilization`` of the device's memory leaves after what is in use,
the profile run's peak activations and a reserve for CUDA graphs; on the CPU it is ``max_batch_size *
max_context`` capped by a share of the host's available memory. A cache that cannot hold one request of
``max_context`` tokens is an error, never a silent shrink.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from compile_attn.errors import KVCacheTooSmallError
from compile_attn.layer import AttentionLayer

GiB = 2**30
# Reserved for CUDA graphs on top of one more copy of the profile's peak activations (the shared graph pool
# holds about one forward of the largest token bucket): the decode graphs' own activations, graph objects,
# Inductor's allocations during capture and allocator fragmentation.
CUDA_GRAPH_MARGIN_BYTES = 1 * GiB
# Share of the host's available memory that a default CPU KV cache may take.
CPU_KV_MEMORY_FRACTION = 0.25


@dataclass(frozen=True)
class KVSizing:
    """The tokens chosen and the figures they came from (bytes), for the log and for tests."""

    kv_cache_tokens: int
    bytes_per_token: int
    page_size: int
    max_context: int
    limit_bytes: int  # what the engine may use in all (utilization x total), or the CPU share
    used_bytes: int  # in use before the KV cache: weights, request table, backend buffers, CUDA context, others
    peak_activation_bytes: int
    graph_reserve_bytes: int
    kv_budget_bytes: int  # limit - used - activations - graphs: what the pool, scratch page included, may take
    capped_by_requests: bool  # True: max_batch_size requests of max_context tokens fit, and more is never used
    on_host: bool = False  # sized from host memory (CPU), not from a device profile

    @property
    def kv_bytes(self) -> int:
        """Bytes of the pool that results, scratch page included."""
        return (self.kv_cache_tokens + self.page_size) * self.bytes_per_token

    @property
    def max_context_requests(self) -> float:
        return self.kv_cache_tokens / self.max_context

    def describe(self) -> str:
        head = (
            f"KV cache: {self.kv_cache_tokens:,} tokens ({self.kv_bytes / GiB:.2f} GiB, {self.bytes_per_token:,} B per "
            f"token), {self.max_context_requests:,.1f} requests of max_context {self.max_context:,} fit"
            + (" (max_batch_size of them: the most the engine can use)" if self.capped_by_requests else "")
        )
        if self.on_host:
            return head + f"; at most {self.limit_bytes / GiB:.2f} GiB of host memory"
        return head + (
            f"; limit {self.limit_bytes / GiB:.2f} GiB = in use {self.used_bytes / GiB:.2f} + activations "
            f"{self.peak_activation_bytes / GiB:.2f} + CUDA graph reserve {self.graph_reserve_bytes / GiB:.2f} + "
            f"KV budget {self.kv_budget_bytes / GiB:.2f}"
        )


def kv_bytes_per_token(layers: Sequence[AttentionLayer], dtype: torch.dtype) -> int:
    """Bytes one token's K and V take over all layers (the pool gives every layer the first layer's shapes)."""
    first = layers[0]
    per_layer = first.num_kv_heads * (first.head_dim + first.v_head_dim)
    return len(layers) * per_layer * torch.empty((), dtype=dtype).element_size()


def _tokens_in(budget_bytes: int, bytes_per_token: int, page_size: int) -> int:
    """Tokens of whole pages that fit ``budget_bytes`` once the pool's scratch page is taken out."""
    pages = budget_bytes // (bytes_per_token * page_size) - 1
    return max(pages, 0) * page_size


def _most_usable(max_batch_size: int, max_context: int, page_size: int) -> int:
    """Tokens ``max_batch_size`` requests of ``max_context`` tokens hold, each rounded up to whole pages."""
    return max_batch_size * -(-max_context // page_size) * page_size


def size_from_device_memory(
    *,
    total_bytes: int,
    free_bytes: int,
    peak_activation_bytes: int,
    graph_reserve_bytes: int,
    utilization: float,
    bytes_per_token: int,
    page_size: int,
    max_context: int,
    max_batch_size: int,
) -> KVSizing:
    """KV tokens from device memory, measured after the weights loaded and a profile run::

        limit     = floor(utilization * total_bytes)
        used      = total_bytes - free_bytes          (weights, CUDA context, other processes, ...)
        budget    = limit - used - peak_activation_bytes - graph_reserve_bytes
        pages     = budget // (bytes_per_token * page_size) - 1     (the pool adds one scratch page)
        tokens    = min(max(pages, 0) * page_size, max_batch_size * ceil(max_context / page_size) * page_size)

    so the engine's memory, KV included, stays within ``limit``. Raises KVCacheTooSmallError when ``tokens <
    max_context``, naming the figures and the ways out.
    """
    limit = int(utilization * total_bytes)
    used = total_bytes - free_bytes
    budget = limit - used - peak_activation_bytes - graph_reserve_bytes
    fit = _tokens_in(budget, bytes_per_token, page_size)
    most = _most_usable(max_batch_size, max_context, page_size)
    sizing = KVSizing(
        kv_cache_tokens=min(fit, most), bytes_per_token=bytes_per_token, page_size=page_size, max_context=max_context,
        limit_bytes=limit, used_bytes=used, peak_activation_bytes=peak_activation_bytes,
        graph_reserve_bytes=graph_reserve_bytes, kv_budget_bytes=budget, capped_by_requests=fit >= most,
    )
    if sizing.kv_cache_tokens < max_context:
        raise KVCacheTooSmallError(
            f"the KV cache would hold {sizing.kv_cache_tokens:,} tokens, fewer than one request of max_context "
            f"{max_context:,}: gpu_memory_utilization {utilization} of {total_bytes / GiB:.2f} GiB allows "
            f"{limit / GiB:.2f} GiB, of which {used / GiB:.2f} GiB are in use (weights, CUDA context, other "
            f"processes), {peak_activation_bytes / GiB:.2f} GiB go to activations and {graph_reserve_bytes / GiB:.2f} "
            f"GiB to CUDA graphs, leaving {budget / GiB:.2f} GiB at {bytes_per_token:,} bytes per token; lower "
            f"max_context, raise gpu_memory_utilization, or pass kv_cache_tokens"
        )
    return sizing


def size_for_host_memory(
    *,
    available_bytes: int | None,
    bytes_per_token: int,
    page_size: int,
    max_context: int,
    max_batch_size: int,
    fraction: float = CPU_KV_MEMORY_FRACTION,
) -> KVSizing:
    """KV tokens on the CPU: ``max_batch_size * max_context`` (whole pages per request), capped at what fits in
    ``fraction`` of the host's available memory (no cap when ``available_bytes`` is None)::

        tokens = min(max_batch_size * ceil(max_context / page_size) * page_size,
                     (floor(fraction * available_bytes) // (bytes_per_token * page_size) - 1) * page_size)

    Raises KVCacheTooSmallError when ``tokens < max_context``.
    """
    most = _most_usable(max_batch_size, max_context, page_size)
    limit = int(fraction * available_bytes) if available_bytes is not None else (most + page_size) * bytes_per_token
    fit = _tokens_in(limit, bytes_per_token, page_size)
    sizing = KVSizing(
        kv_cache_tokens=min(fit, most), bytes_per_token=bytes_per_token, page_size=page_size, max_context=max_context,
        limit_bytes=limit, used_bytes=0, peak_activation_bytes=0, graph_reserve_bytes=0, kv_budget_bytes=limit,
        capped_by_requests=fit >= most, on_host=True,
    )
    if sizing.kv_cache_tokens < max_context:
        raise KVCacheTooSmallError(
            f"the KV cache would hold {sizing.kv_cache_tokens:,} tokens, fewer than one request of max_context "
            f"{max_context:,}: a default CPU cache takes at most {fraction} of the host's "
            f"{(available_bytes or 0) / GiB:.2f} GiB available memory ({limit / GiB:.2f} GiB) at "
            f"{bytes_per_token:,} bytes per token; lower max_context, or pass kv_cache_tokens"
        )
    return sizing


def host_available_bytes() -> int | None:
    """The host's available memory (``MemAvailable`` of /proc/meminfo; None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
