"""The profile run that sizes the default KV cache: after the weights are loaded, one eager forward of
``max_num_tokens`` tokens (plus the LM head and the sampler on ``max_batch_size`` rows) over a small temporary
KV cache measures peak activation memory; ``kv_sizing`` turns the figures into tokens.

The temporary cache has the engine's request table and the backend its CUDA-graph buffers, so what stays in
use afterwards counts them: both grow with ``max_context`` (``req_to_token`` is ``[max_batch_size + 1,
max_context]`` int32, a decode index about ``max_batch_size * max_context`` int32), so a long max_context costs
memory besides the KV. The forward is a prefill from an empty cache: a backend whose attention memory
grows with the cached prefix (torch_native's dense scores) is not bounded by it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from compile_attn.attention import create_backend
from compile_attn.attention.base import AttentionBackend
from compile_attn.batch import ForwardBatch
from compile_attn.context import forward_context
from compile_attn.engine.execution.kv_sizing import (
    CUDA_GRAPH_MARGIN_BYTES,
    GiB,
    KVSizing,
    host_available_bytes,
    kv_bytes_per_token,
    size_for_host_memory,
    size_from_device_memory,
)
from compile_attn.engine.execution.sampling.sampler import sample
from compile_attn.kv.cache import KVCache
from compile_attn.layer import AttentionLayer

if TYPE_CHECKING:
    from compile_attn.engine.requests.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int
    free_bytes: int  # after the profile run, with the temporary KV pool's bytes given back
    peak_activation_bytes: int


def profile_lengths(max_num_tokens: int, max_context: int, max_batch_size: int) -> list[int]:
    """The profile batch: ``max_num_tokens`` tokens in as few requests as ``max_context`` allows (the longest
    prefill chunks), at most ``max_batch_size`` of them."""
    lengths = []
    left = max_num_tokens
    while left > 0 and len(lengths) < max_batch_size:
        lengths.append(min(left, max_context))
        left -= lengths[-1]
    return lengths


@contextlib.contextmanager
def profile_batch(
    layers: Sequence[AttentionLayer],
    *,
    attn_backend: str,
    max_batch_size: int,
    max_num_tokens: int,
    max_context: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    graphs: bool,
) -> Iterator[tuple[KVCache, AttentionBackend, ForwardBatch]]:
    """A temporary KV cache (the engine's request table, KV room for the batch only), a backend over it (with its
    CUDA-graph buffers when ``graphs``) and the profile batch, with its slots allocated."""
    lengths = profile_lengths(max_num_tokens, max_context, max_batch_size)
    kv = KVCache.for_layers(layers, max_batch_size=max_batch_size, max_context=max_context,
                            kv_cache_tokens=sum(-(-n // page_size) * page_size for n in lengths), page_size=page_size,
                            dtype=dtype, device=device)
    backend = create_backend(attn_backend, kv, layers)
    if graphs:
        backend.init_cuda_graph_state(max_batch_size, max_num_tokens)
    rows = [kv.alloc_request() for _ in lengths]
    fb = ForwardBatch.build(
        req_pool_indices=rows, prefix_lens=[0] * len(rows), extend_lens=lengths,
        out_cache_loc=kv.alloc_extend(rows, lengths), device=device,
    )
    yield kv, backend, fb


@torch.inference_mode()
def profile_forward(model: Any, backend: AttentionBackend, fb: ForwardBatch, num_rows: int) -> torch.Tensor:
    """One eager step of ``fb`` as the engine runs it: the forward, the LM head on ``num_rows`` rows, the sampler
    with temperature, top-k and top-p on (its most memory-hungry path). Returns the sampled ids."""
    backend.init_forward_metadata(fb)
    with forward_context(fb, backend):
        if callable(getattr(model, "compute_logits", None)) and callable(getattr(model, "hidden_states", None)):
            logits = model.compute_logits(model.hidden_states(fb.input_ids, fb.positions)[:num_rows])
        else:
            logits = model(fb.input_ids, fb.positions)[:num_rows]
    ones = torch.ones(num_rows, dtype=torch.float32, device=logits.device)
    ids = torch.arange(num_rows, dtype=torch.int64, device=logits.device)
    return sample(logits, temperature=ones, top_k=ids + 50, top_p=ones * 0.9, seeds=ids, positions=ids)


def profile_memory(model: Any, layers: Sequence[AttentionLayer], *, device: torch.device, max_batch_size: int,
                   max_num_tokens: int, **options: Any) -> MemoryProfile:
    """Run the profile step on ``device`` (CUDA) and measure its peak activations, and the memory free after it
    (the temporary KV pool's bytes counted as free). ``options``: the rest of ``profile_batch``'s arguments."""
    with profile_batch(layers, device=device, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                       **options) as (kv, backend, fb):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        profile_forward(model, backend, fb, min(max_batch_size, fb.num_tokens))
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        profile = MemoryProfile(total_bytes=total, free_bytes=free + kv.pool.bytes, peak_activation_bytes=peak)
        logger.info("profile step of %d tokens (%d requests): peak activations %.2f GiB; %.2f of %.2f GiB in use",
                    fb.num_tokens, fb.batch_size, peak / GiB, (total - profile.free_bytes) / GiB, total / GiB)
    del kv, backend, fb  # the temporary cache and backend go before the engine's own are built
    torch.cuda.empty_cache()
    return profile


def size_kv_cache(model: Any, layers: Sequence[AttentionLayer], config: EngineConfig, max_context: int) -> KVSizing:
    """The default KV cache size for ``config`` (see kv_sizing): from a profile run on CUDA, capped by host memory
    on the CPU, ``max_batch_size * max_context`` elsewhere. Logs the tokens and requests that fit."""
    device, dtype, page_size, max_batch_size = config.device, config.kv_dtype, config.page_size, config.max_batch_size
    graphs = config.uses_graphs
    per_token = kv_bytes_per_token(layers, dtype)
    if device.type == "cuda":
        profile = profile_memory(
            model, layers, attn_backend=config.attn_backend, max_batch_size=max_batch_size,
            max_num_tokens=config.max_num_tokens, max_context=max_context, page_size=page_size, dtype=dtype,
            device=device, graphs=graphs,
        )
        reserve = profile.peak_activation_bytes + CUDA_GRAPH_MARGIN_BYTES if graphs else 0
        sizing = size_from_device_memory(
            total_bytes=profile.total_bytes, free_bytes=profile.free_bytes,
            peak_activation_bytes=profile.peak_activation_bytes, graph_reserve_bytes=reserve,
            utilization=config.gpu_memory_utilization, bytes_per_token=per_token, page_size=page_size,
            max_context=max_context, max_batch_size=max_batch_size,
        )
    else:
        sizing = size_for_host_memory(
            available_bytes=host_available_bytes() if device.type == "cpu" else None, bytes_per_token=per_token,
            page_size=page_size, max_context=max_context, max_batch_size=max_batch_size,
        )
    logger.info("%s%s", sizing.describe(), kv_dtype_note(dtype, config.dtype))
    return sizing


def kv_dtype_note(kv_dtype: torch.dtype, model_dtype: torch.dtype) -> str:
    """What the KV cache stores when that is not the model's dtype (for the sizing log line)."""
    if kv_dtype == model_dtype:
        return ""
    ratio = model_dtype.itemsize / kv_dtype.itemsize
    return (f"; {str(kv_dtype).removeprefix('torch.')} KV cache: {kv_dtype.itemsize} byte(s) per element, "
            f"{ratio:g}x the tokens of a {str(model_dtype).removeprefix('torch.')} cache")


def check_memory_after_capture(device: torch.device, gpu_memory_utilization: float) -> None:
    """Warn when the engine, graphs captured, uses more device memory than ``gpu_memory_utilization`` allows
    (the CUDA graph reserve was too small for this model)."""
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    used, limit = total - free, gpu_memory_utilization * total
    log = logger.warning if used > limit else logger.info
    log("device memory after start-up: %.2f GiB in use of %.2f GiB allowed (gpu_memory_utilization %s of %.2f GiB)%s",
        used / GiB, limit / GiB, gpu_memory_utilization, total / GiB,
        "; the CUDA graph reserve was too small: lower gpu_memory_utilization or pass kv_cache_tokens"
        if used > limit else "")
