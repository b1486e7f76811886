"""fa3: attention through sgl-kernel's FlashAttention-3 (``sgl_kernel.flash_attn.flash_attn_with_kvcache``).

The kernel reads K/V straight from the pool, viewed as ``[num_pages + 1, page_size, Hkv, D]`` pages, through
a ``page_table [B, pages]`` gathered from ``req_to_token`` and int32 ``cache_seqlens``. Decode is full-graph
capturable: ``init_cuda_graph_state`` allocates a static page table and seq-len buffer, and
``init_forward_metadata_in_graph`` refills them on the device (static shapes). Extend/mixed batches pass
varlen queries (``cu_seqlens_q``) over the same paged pool and run eagerly between captured pieces.
Verification steps whose drafts form chains run as these causal extends; FA3 takes no custom mask, so draft trees
are refused by name (``AttentionBackend.check_tree_verify``).

An fp8_e4m3 pool is read through FA3's fp8 kernels, which take queries in fp8 too: the queries are quantised per
(request, KV head) on decode steps (scale = amax / 448 over the row's query heads of that KV head: no clipping,
batch-invariant) and per KV head over the step's tokens on extend steps, and the pool's per-KV-head scales go in as
``k_descale`` / ``v_descale`` (``[batch, Hkv]`` views with batch stride 0, read at run time, so graphs captured
earlier see calibrated values). FA3 has no e5m2 kernels: an fp8_e5m2 pool is refused by name.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from compile_attn.attention.base import AttentionBackend
from compile_attn.attention.registry import register_backend
from compile_attn.batch import ForwardBatch
from compile_attn.errors import BackendUnavailableError, UnsupportedConfigError
from compile_attn.graph_mode import GraphMode
from compile_attn.host_tensors import upload
from compile_attn.kv.cache import KVCache
from compile_attn.kv.fp8 import fp8_max
from compile_attn.layer import AttentionLayer

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    'pip install "compile-attn[fa3]"  (installs sglang-kernel 0.4.x; each release is built for one torch + CUDA: '
    "install the sglang-kernel release built for yours, e.g. sglang-kernel 0.4.3 for torch 2.11 + CUDA 13)"
)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
# sgl-kernel builds its FA3 kernels for these compute capabilities only.
SUPPORTED_CAPABILITIES = ((8, 0), (8, 6), (8, 9), (9, 0))


def build_page_table(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, num_pages: int, page_size: int
) -> torch.Tensor:
    """``[B, num_pages]`` int32 page ids: page j of request b holds positions ``j*P..``. Entries past a request's
    last page point at the scratch page 0. Static-shaped, so it can be recorded in a CUDA graph."""
    cols = torch.arange(num_pages, device=req_to_token.device) * page_size
    cols = cols.clamp_(max=req_to_token.shape[1] - 1)
    return torch.div(req_to_token[req_pool_indices][:, cols], page_size, rounding_mode="floor").to(torch.int32)


def load_fa3() -> ModuleType:
    """``sgl_kernel.flash_attn``, or BackendUnavailableError naming the install command."""
    try:
        from sgl_kernel import flash_attn
    except (ImportError, OSError) as exc:  # OSError: a wheel built against another torch / CUDA
        raise BackendUnavailableError(
            f"the fa3 attention backend needs sgl_kernel (importing sgl_kernel.flash_attn failed: {exc}). "
            f"Install it with: {INSTALL_HINT}; or use backend='flashinfer' or 'triton'"
        ) from exc
    return flash_attn


def check_fa3_device(device: torch.device) -> None:
    """Raise BackendUnavailableError unless ``device`` is a CUDA GPU that sgl-kernel has FA3 kernels for."""
    if device.type != "cuda":
        raise BackendUnavailableError(
            f"the fa3 backend runs on CUDA GPUs but the KV cache is on {device}; use backend='torch_native' "
            f"on the CPU"
        )
    check_fa3_capability(torch.cuda.get_device_capability(device))


def check_fa3_capability(capability: tuple[int, int]) -> None:
    """Raise BackendUnavailableError if sgl-kernel ships no FA3 kernel for compute capability ``capability``."""
    if tuple(capability) not in SUPPORTED_CAPABILITIES:
        supported = ", ".join(f"sm{major}{minor}" for major, minor in SUPPORTED_CAPABILITIES)
        raise BackendUnavailableError(
            f"the fa3 backend has kernels for {supported} only, but this GPU is sm{capability[0]}{capability[1]}; "
            f"use backend='flashinfer' or 'triton' (or 'auto')"
        )


def quantize_queries(q: torch.Tensor, num_kv_heads: int, dtype: torch.dtype,
                     per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` (``[..., Hq, D]``: ``[bs, 1, Hq, D]`` decode, ``[T, Hq, D]`` extend) in ``dtype`` (fp8) with its float32
    descale: ``[bs, Hkv]`` (``per_row``: each row's own amax per KV head's query heads) or ``[1, Hkv]`` (amax over
    all tokens). ``q_real = q_fp8 * descale``; an all-zero group gets descale 1."""
    limit = fp8_max(dtype)
    tokens = q.shape[0]
    grouped = q.float().reshape(tokens, -1, num_kv_heads, q.shape[-2] // num_kv_heads, q.shape[-1])
    amax = grouped.abs().amax(dim=(1, 3, 4))  # [tokens, Hkv]
    if not per_row:
        amax = amax.amax(dim=0, keepdim=True)
    descale = torch.where(amax > 0, amax / limit, torch.ones_like(amax))
    q8 = (grouped / descale[:, None, :, None, None] if per_row else grouped / descale[0][None, None, :, None, None])
    return q8.clamp_(-limit, limit).to(dtype).reshape(q.shape), descale


@dataclass
class FA3Step:
    """Metadata of one step: request b reads pool pages ``page_table[b]`` up to ``cache_seqlens[b]`` tokens."""

    is_decode: bool
    batch_size: int
    num_tokens: int  # tokens that belong to a request; padding tokens of a bucket come after them
    page_table: torch.Tensor  # [bs, pages] int32
    cache_seqlens: torch.Tensor  # [bs] int32
    cu_seqlens_q: torch.Tensor | None = None  # [bs + 1] int32, extend only
    max_seqlen_q: int | None = None  # extend only
    filled: bool = False  # decode: set by init_forward_metadata_in_graph


@dataclass
class FA3GraphBuffers:
    """Static decode buffers for graphs of up to ``max_bs`` requests."""

    max_bs: int
    page_table: torch.Tensor  # [max_bs, ceil(graph_max_context / page_size)] int32
    cache_seqlens: torch.Tensor  # [max_bs] int32


@register_backend("fa3")
class FA3Backend(AttentionBackend):
    """FlashAttention-3 over the paged KV pool; decode is full-graph capturable, extend runs piecewise."""

    graph_support = GraphMode.FULL_AND_PIECEWISE

    def __init__(
        self,
        kv_cache: KVCache,
        layers: Sequence[AttentionLayer] | Mapping[int, AttentionLayer],
        *,
        graph_max_context: int | None = None,
    ) -> None:
        """``graph_max_context``: longest sequence a decode graph serves (default the cache's max_context);
        it sets the width of the static page table."""
        self._fa = load_fa3()
        check_fa3_device(kv_cache.device)
        super().__init__(kv_cache, layers)
        pool = kv_cache.pool
        self.page_size = pool.page_size
        self.graph_max_context = graph_max_context or kv_cache.max_context
        ps = self.page_size
        self._pages = {  # [num_pages + 1, page_size, Hkv, D] views of the pool's slot buffers
            lid: tuple(buf.view(-1, ps, *buf.shape[1:]) for buf in pool.get_kv(lid)) for lid in self.layers
        }
        self._graph: FA3GraphBuffers | None = None
        self._step: FA3Step | None = None
        logger.info("fa3 backend: %d layers, page_size %d, %s", len(self.layers), ps, pool.dtype)

    # ------------------------------------------------------------------ configuration checks
    def check_layer(self, layer: AttentionLayer) -> None:
        super().check_layer(layer)
        if layer.head_dim not in SUPPORTED_HEAD_DIMS:
            raise UnsupportedConfigError(
                f"layer {layer.layer_id}: head_dim {layer.head_dim} is not supported by the fa3 backend; supported: "
                f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}; use backend='triton' or 'torch_native'"
            )
        if layer.v_head_dim != layer.head_dim:
            raise UnsupportedConfigError(
                f"layer {layer.layer_id}: v_head_dim {layer.v_head_dim} != head_dim {layer.head_dim}; the fa3 backend "
                f"needs equal K and V head dims; use backend='triton' or 'torch_native'"
            )
        if self.kv_cache.pool.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedConfigError(
                f"KV cache dtype {self.kv_cache.pool.dtype} is not supported by the fa3 backend (its fp8 kernels are "
                f"e4m3 only); create the KVCache with dtype torch.bfloat16, torch.float16 or torch.float8_e4m3fn "
                f"(kv_cache_dtype='fp8_e4m3'), or use backend='flashinfer' or 'triton' for fp8_e5m2"
            )

    # ------------------------------------------------------------------ inspection (tests, debugging)
    @property
    def step_metadata(self) -> FA3Step | None:
        return self._step

    @property
    def graph_buffers(self) -> FA3GraphBuffers | None:
        return self._graph

    # ------------------------------------------------------------------ metadata contract
    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # a padded request reads one token: row PAD_REQUEST's scratch slot

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if self._graph is not None and self._graph.max_bs >= max_bs:
            return  # graphs captured so far keep their buffers
        width = -(-self.graph_max_context // self.page_size)
        self._graph = FA3GraphBuffers(
            max_bs=max_bs,
            page_table=torch.zeros(max_bs, width, dtype=torch.int32, device=self.device),
            cache_seqlens=torch.ones(max_bs, dtype=torch.int32, device=self.device),
        )

    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        if fb.forward_mode.is_idle() or fb.batch_size == 0:
            self._step = None
        elif fb.forward_mode.is_decode():
            self._step = self._bind_graph_decode(fb) if fb.graph_bucket is not None else self._alloc_eager_decode(fb)
        else:
            self.check_tree_verify(fb)
            self._step = self._prepare_extend(fb)

    def init_forward_metadata_in_graph(self, fb: ForwardBatch) -> None:
        """Gather the decode page table from ``req_to_token`` and copy seq lens: static shapes, no host sync."""
        step = self._step
        if step is None or not step.is_decode:
            return  # extend metadata is prepared in out_graph
        width = step.page_table.shape[1]
        step.page_table.copy_(build_page_table(self.kv_cache.req_to_token, fb.req_pool_indices, width, self.page_size))
        step.cache_seqlens.copy_(fb.seq_lens)
        step.filled = True

    def _bind_graph_decode(self, fb: ForwardBatch) -> FA3Step:
        graph = self._graph
        self.check_graph_view(fb, None if graph is None else graph.max_bs, self.graph_max_context)
        bs = fb.batch_size
        return FA3Step(True, bs, bs, graph.page_table[:bs], graph.cache_seqlens[:bs])

    def _alloc_eager_decode(self, fb: ForwardBatch) -> FA3Step:
        bs = fb.batch_size
        width = -(-int(fb.seq_lens_cpu.max()) // self.page_size)
        return FA3Step(
            True, bs, bs,
            page_table=torch.empty(bs, width, dtype=torch.int32, device=self.device),
            cache_seqlens=torch.empty(bs, dtype=torch.int32, device=self.device),
        )

    def _prepare_extend(self, fb: ForwardBatch) -> FA3Step:
        ext = fb.extend_seq_lens_cpu
        cu_cpu = torch.zeros(len(ext) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(ext, dtype=torch.int64), dim=0, dtype=torch.int32, out=cu_cpu[1:])
        width = -(-int(fb.seq_lens_cpu.max()) // self.page_size)
        page_table = build_page_table(self.kv_cache.req_to_token, fb.req_pool_indices, width, self.page_size)
        return FA3Step(
            is_decode=False, batch_size=fb.batch_size, num_tokens=int(cu_cpu[-1]), page_table=page_table,
            cache_seqlens=fb.seq_lens.to(torch.int32), cu_seqlens_q=upload(cu_cpu, self.device),
            max_seqlen_q=max(ext, default=1), filled=True,
        )

    def _require_step(self, decode: bool) -> FA3Step:
        step = self._step
        if step is None or step.is_decode != decode or not step.filled:
            raise RuntimeError(
                f"the fa3 backend has no {'decode' if decode else 'extend'} metadata for this batch: call "
                f"backend.init_forward_metadata(batch) (or out_graph then in_graph) before the forward"
            )
        return step

    # ------------------------------------------------------------------ compute
    def _attend(self, q: torch.Tensor, layer: AttentionLayer, step: FA3Step) -> torch.Tensor:
        """FA3 over the pool. Its ``causal`` mask is aligned to the bottom-right corner (the last query of a
        request sits at the last key), so query i of a request with prefix P sees keys j <= P + i; its window
        ``(left, right)`` keeps keys in ``[i + Lk - Lq - left, i + Lk - Lq + right]``, so ``left = W - 1``
        gives HF's ``p - W < j <= p``."""
        k_pages, v_pages = self._pages[layer.layer_id]
        if layer.sliding_window is not None:
            window = (layer.sliding_window - 1, 0 if layer.causal else -1)
        else:
            window = (-1, -1)
        scales = self.kv_cache.pool.kv_scales(layer.layer_id)
        descale: dict[str, torch.Tensor] = {}
        if scales is not None:
            batch = step.batch_size
            q, q_descale = quantize_queries(q, scales[0].shape[0], k_pages.dtype, per_row=step.is_decode)
            descale = dict(q_descale=q_descale.expand(batch, -1), k_descale=scales[0].expand(batch, -1),
                           v_descale=scales[1].expand(batch, -1))
        return self._fa.flash_attn_with_kvcache(
            q.to(k_pages.dtype).contiguous(), k_pages, v_pages,
            cache_seqlens=step.cache_seqlens,
            page_table=step.page_table,
            cu_seqlens_q=step.cu_seqlens_q,
            max_seqlen_q=step.max_seqlen_q,
            softmax_scale=layer.scaling,
            causal=layer.causal,
            window_size=window,
            softcap=layer.logit_cap,
            **descale,
        )

    def _require_save(self, save_kv_cache: bool) -> None:
        if not save_kv_cache:
            raise UnsupportedConfigError(
                "the fa3 backend reads the step's K/V from the pool, so it needs save_kv_cache=True; "
                "use backend='torch_native' to attend without saving K/V"
            )

    def forward_decode(self, q, k, v, layer, fb, out, save_kv_cache) -> None:
        step = self._require_step(decode=True)
        self._require_save(save_kv_cache)
        self.save_kv(layer, fb, k, v)
        bs = step.batch_size
        o = self._attend(q[:bs].unsqueeze(1), layer, step)  # [bs, 1, Hq, D]
        out[:bs].copy_(o.view(bs, *out.shape[1:]))
        if out.shape[0] > bs:
            out[bs:].zero_()

    def forward_extend(self, q, k, v, layer, fb, out, save_kv_cache) -> None:
        step = self._require_step(decode=False)
        self._require_save(save_kv_cache)
        self.save_kv(layer, fb, k, v)  # padding tokens of a bucket write the scratch slot
        n = step.num_tokens
        if n:
            out[:n].copy_(self._attend(q[:n], layer, step))
        if out.shape[0] > n:
            out[n:].zero_()  # padding tokens of a graph bucket
