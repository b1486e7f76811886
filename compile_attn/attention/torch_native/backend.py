"""torch_native: the reference attention backend in plain torch ops, on CPU and CUDA.

Extend (and mixed) batches loop over requests on the host and gather each request's KV from the
pool. Decode is batched and graph-capturable: the slot table of every request is gathered up to a
fixed width into a static buffer and masked by sequence length, so a full decode CUDA graph can be
tested with this backend before the fast ones. Masked positions are replaced (``torch.where``) before any
product, so whatever unused slots hold never reaches the output. Scores are computed in float32. Slow by
design. Verification steps run as extends; a draft tree (``fb.draft_parents``) masks each request's new tokens
with its ancestor mask, and the sliding window uses rotary positions (``prefix + depth``). Over an fp8 pool every
key and value is read as the pool holds it, dequantised with the layer's scales (``kv/fp8.py``): those of the
step's new tokens too, rounded through the pool's format when they are not read from it, so decode, extend and
verification steps all see the same stored values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from compile_attn.attention.base import AttentionBackend
from compile_attn.attention.registry import register_backend
from compile_attn.batch import ForwardBatch
from compile_attn.draft_tree import ancestor_mask, depths, has_tree
from compile_attn.graph_mode import GraphMode
from compile_attn.kv.cache import KVCache
from compile_attn.kv.fp8 import dequantize, quantize
from compile_attn.kv.pools import PagedKVPool
from compile_attn.layer import AttentionLayer


@dataclass
class _DecodeMetadata:
    table: torch.Tensor  # [bs, width] slots of positions 0..width-1 of each request
    seq_lens: torch.Tensor  # [bs]


@dataclass
class _TreeMetadata:
    """A verification step's draft trees, per request: new tokens' depths [n] and ancestor masks [n, n]."""

    draft_parents: tuple[tuple[int, ...], ...]  # what they were built from (the batch's own tuple)
    depths: list[torch.Tensor]
    ancestors: list[torch.Tensor]

    @classmethod
    def build(cls, draft_parents: tuple[tuple[int, ...], ...], device: torch.device) -> _TreeMetadata:
        return cls(draft_parents, [torch.tensor(depths(p), dtype=torch.long, device=device) for p in draft_parents],
                   [ancestor_mask(p).to(device) for p in draft_parents])


def _masked_attention(
    q: torch.Tensor,  # [N, Hkv, G, D]  float32
    k: torch.Tensor,  # [N, L, Hkv, D]   float32
    v: torch.Tensor,  # [N, L, Hkv, Dv]  float32
    allowed: torch.Tensor,  # [N, Q, L] bool, Q = 1 (decode) or the query count
    layer: AttentionLayer,
) -> torch.Tensor:
    """Softmax attention for N independent problems; returns ``[N, Q, Hkv, G, Dv]`` (Q query rows)."""
    # q: [N, Q, Hkv, G, D] expected; callers reshape so Q is explicit.
    # Keys no query may see (past a request's length: the scratch slot, stale or never-written slots) can hold
    # anything, NaN included; 0 * NaN is NaN, so they are replaced, not multiplied by a 0/1 mask.
    key_used = allowed.any(dim=1)[:, :, None, None]  # [N, L, 1, 1]
    k = torch.where(key_used, k, 0.0)
    v = torch.where(key_used, v, 0.0)
    scores = torch.einsum("nqhgd,nlhd->nhgql", q, k) * layer.scaling
    if layer.logit_cap > 0:
        scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
    scores = scores.masked_fill(~allowed[:, None, None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with nothing visible (never for valid batches)
    return torch.einsum("nhgql,nlhd->nqhgd", probs, v)


def _gather(pool: PagedKVPool, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V at ``slots`` (any shape) as float32 real values: an fp8 pool's bytes dequantised with the layer's
    scales (gathered as bytes: fp8 indexing has no kernel on every device)."""
    k_buf, v_buf = pool.get_kv(layer_id)
    scales = pool.kv_scales(layer_id)
    if scales is None:
        return k_buf[slots].float(), v_buf[slots].float()
    k = k_buf.view(torch.uint8)[slots].view(pool.dtype)
    v = v_buf.view(torch.uint8)[slots].view(pool.dtype)
    return dequantize(k, scales[0]), dequantize(v, scales[1])


def _as_stored(pool: PagedKVPool, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's new ``k``/``v`` as float32, as an fp8 pool would hold them (quantised and back)."""
    scales = pool.kv_scales(layer_id)
    if scales is None:
        return k.float(), v.float()
    return (dequantize(quantize(k, scales[0], pool.dtype), scales[0]),
            dequantize(quantize(v, scales[1], pool.dtype), scales[1]))


def _visibility(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
    """``allowed[..., i, j]``: causal (if the layer is), sliding window, and key validity."""
    allowed = k_valid[..., None, :].expand(*q_pos.shape, k_pos.shape[-1]).clone()
    if layer.causal:
        allowed &= k_pos[..., None, :] <= q_pos[..., :, None]
    if layer.sliding_window is not None:
        allowed &= k_pos[..., None, :] > q_pos[..., :, None] - layer.sliding_window
    return allowed


@register_backend("torch_native")
class TorchNativeBackend(AttentionBackend):
    """Plain-torch attention; decode full-graph capturable through static, padded slot tables."""

    graph_support = GraphMode.FULL_AND_PIECEWISE
    tree_verify = True

    def __init__(
        self,
        kv_cache: KVCache,
        layers: Sequence[AttentionLayer] | Mapping[int, AttentionLayer],
        graph_max_context: int | None = None,
    ) -> None:
        """``graph_max_context`` bounds the decode slot-table width in graphs (default: the cache's max_context)."""
        super().__init__(kv_cache, layers)
        self.graph_max_context = graph_max_context or kv_cache.max_context
        self._decode: _DecodeMetadata | None = None
        self._tree: _TreeMetadata | None = None
        self._cg_table: torch.Tensor | None = None

    # ------------------------------------------------------------------ metadata contract
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self._cg_table = torch.zeros(max_bs, self.graph_max_context, dtype=torch.int32, device=self.device)

    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        if not fb.forward_mode.is_decode():
            self._decode = None  # extend reads host lengths at call time
            self._tree = _TreeMetadata.build(fb.draft_parents, self.device) if has_tree(fb.draft_parents) else None
            return
        if fb.graph_bucket is not None:
            allocated = None if self._cg_table is None else self._cg_table.shape[0]
            self.check_graph_view(fb, allocated, self.graph_max_context)
            self._decode = _DecodeMetadata(self._cg_table[: fb.batch_size], fb.seq_lens)
        else:
            width = int(fb.seq_lens_cpu.max()) if fb.batch_size else 1
            table = torch.empty(fb.batch_size, width, dtype=torch.int32, device=self.device)
            self._decode = _DecodeMetadata(table, fb.seq_lens)

    def init_forward_metadata_in_graph(self, fb: ForwardBatch) -> None:
        if not fb.forward_mode.is_decode():
            return
        meta = self._decode
        assert meta is not None, "init_forward_metadata_out_graph must run first"
        width = meta.table.shape[1]
        meta.table.copy_(self.kv_cache.req_to_token[fb.req_pool_indices, :width])

    # ------------------------------------------------------------------ compute
    def forward_decode(self, q, k, v, layer, fb, out, save_kv_cache) -> None:  # noqa: ANN001
        if save_kv_cache:
            self.save_kv(layer, fb, k, v)
        meta = self._decode
        if meta is None:
            raise RuntimeError(
                "torch_native decode metadata is missing: call backend.init_forward_metadata(batch) before the forward"
            )
        pool = self.kv_cache.pool
        table = meta.table.long()
        bs, width = table.shape
        k_all, v_all = _gather(pool, layer.layer_id, table)  # [bs, width, Hkv, D]
        if not save_kv_cache:  # the new token is not in the pool: splice it in at position seq_len - 1
            last = (meta.seq_lens.long() - 1).clamp(min=0)
            k_new, v_new = _as_stored(pool, layer.layer_id, k[:bs], v[:bs])
            k_all[torch.arange(bs, device=k_all.device), last] = k_new
            v_all[torch.arange(bs, device=v_all.device), last] = v_new
        k_pos = torch.arange(width, device=q.device).expand(bs, width)
        k_valid = k_pos < meta.seq_lens[:, None]
        q_pos = (meta.seq_lens.long() - 1)[:, None]  # [bs, 1]
        allowed = _visibility(q_pos, k_pos, k_valid, layer)  # [bs, 1, width]
        qh = q[:bs].float().view(bs, 1, layer.num_kv_heads, layer.group_size, layer.head_dim)
        o = _masked_attention(qh, k_all, v_all, allowed, layer)  # [bs, 1, Hkv, G, Dv]
        out[:bs].copy_(o.reshape(bs, layer.num_heads, layer.v_head_dim))

    def forward_extend(self, q, k, v, layer, fb, out, save_kv_cache) -> None:  # noqa: ANN001
        if save_kv_cache:
            self.save_kv(layer, fb, k, v)
        pool = self.kv_cache.pool
        req_to_token = self.kv_cache.req_to_token
        tree = self._tree_of(fb)
        start = 0
        for b, (prefix, ext) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
            if ext == 0:
                continue
            prefix_slots = req_to_token[fb.req_pool_indices[b], :prefix].long()
            k_old, v_old = _gather(pool, layer.layer_id, prefix_slots)
            k_new, v_new = _as_stored(pool, layer.layer_id, k[start : start + ext], v[start : start + ext])
            k_all = torch.cat([k_old, k_new])[None]
            v_all = torch.cat([v_old, v_new])[None]
            k_pos = torch.arange(prefix + ext, device=q.device)[None]
            q_pos = torch.arange(prefix, prefix + ext, device=q.device)[None]
            if tree is not None:  # rotary positions: prefix + depth; a token sees its ancestors and itself
                q_pos = prefix + tree.depths[b][None]
                k_pos = torch.cat([k_pos[:, :prefix], q_pos], dim=1)
            allowed = _visibility(q_pos, k_pos, torch.ones_like(k_pos, dtype=torch.bool), layer)
            if tree is not None:
                allowed[:, :, prefix:] &= tree.ancestors[b]
            qh = q[start : start + ext].float().view(1, ext, layer.num_kv_heads, layer.group_size, layer.head_dim)
            o = _masked_attention(qh, k_all, v_all, allowed, layer)
            out[start : start + ext].copy_(o.reshape(ext, layer.num_heads, layer.v_head_dim))
            start += ext
        if start < out.shape[0]:
            out[start:].zero_()  # padding tokens of a graph bucket

    def _tree_of(self, fb: ForwardBatch) -> _TreeMetadata | None:
        """The draft trees of ``fb`` (None for chains): those ``out_graph`` prepared, or built now for a batch that
        came without it."""
        parents = fb.draft_parents
        if parents is None or (self._tree is not None and self._tree.draft_parents is parents):
            return None if parents is None else self._tree
        if not has_tree(parents):
            return None
        self._tree = _TreeMetadata.build(parents, self.device)
        return self._tree
