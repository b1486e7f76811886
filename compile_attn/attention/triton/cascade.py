"""Shared-prefix (cascade) decode for the triton backend: which batches take it, their metadata, and the layer call.

A decode batch takes the cascade path when the model has no sliding-window layers and the batch carries
shared-prefix groups (``ForwardBatch.shared_prefix``, set by whoever builds the batch: the engine with
``EngineConfig.cascade_decode``): run eagerly, or as a graph runner view that the runner passed them on to, which it
does for the decode batches it runs through piecewise graphs (attention eager between captured pieces; the view's
padding tokens belong to no request). Full decode graphs keep the plain split-K kernel: the cascade kernels' grid follows the groups,
which a captured graph would freeze. (Capturing a second full decode graph per bucket with the cascade kernels at
their largest grid, index buffers at capacity, would save the piecewise step's host overhead; it is not built.)
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from compile_attn.attention.kernels.cascade_attention import cascade_decode_fwd
from compile_attn.attention.kernels.cascade_index import CascadeIndex, build_cascade_index
from compile_attn.batch import ForwardBatch
from compile_attn.kv.cache import KVCache
from compile_attn.layer import AttentionLayer
from compile_attn.batch import SharedPrefixGroup


@dataclass
class CascadeStep:
    """Metadata of one shared-prefix decode step."""

    batch_size: int
    groups: tuple[SharedPrefixGroup, ...]
    index: CascadeIndex


class CascadePlanner:
    """Builds the ``CascadeStep`` of decode batches that carry shared-prefix groups and runs their layers.
    ``steps`` counts the decode steps that took the cascade path (tests, debugging)."""

    def __init__(self, kv_cache: KVCache, ops: ModuleType) -> None:
        self.kv_cache, self.ops = kv_cache, ops
        self.steps = 0

    def prepare(self, fb: ForwardBatch) -> CascadeStep | None:
        """The cascade metadata of decode batch ``fb``, or None when it carries no shared-prefix group."""
        groups = tuple(fb.shared_prefix or ())
        if not groups:
            return None
        rows = fb.req_pool_indices_cpu if fb.req_pool_indices_cpu is not None else fb.req_pool_indices.tolist()
        index = build_cascade_index(
            self.kv_cache.req_to_token, fb.req_pool_indices, fb.seq_lens, [(g.members, g.prefix_len) for g in groups],
            req_pool_indices_cpu=rows, seq_lens_cpu=fb.seq_lens_cpu.tolist(),
        )
        self.steps += 1
        return CascadeStep(fb.batch_size, groups, index)

    def forward(self, step: CascadeStep, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                fb: ForwardBatch, out: torch.Tensor, save_kv_cache: bool) -> None:
        """Store the step's new K/V (``save_kv_cache``), then shared-prefix decode attention into ``out``."""
        k_buf, v_buf = self.kv_cache.pool.get_kv(layer.layer_id)
        scales = self.kv_cache.pool.kv_scales(layer.layer_id)  # an fp8 pool's (k_scale, v_scale), else None
        kw = {} if scales is None else {"k_scale": scales[0], "v_scale": scales[1]}
        if save_kv_cache:
            self.ops.store_kv(k_buf, v_buf, fb.out_cache_loc, k.contiguous(), v.contiguous(), **kw)
        bs = step.batch_size
        q = q[:bs].contiguous()
        target = out[:bs] if out.stride(-1) == 1 else torch.empty_like(out[:bs])
        cascade_decode_fwd(q, k_buf, v_buf, target, step.index, layer.scaling, layer.logit_cap, **kw)
        if target.data_ptr() != out.data_ptr():
            out[:bs].copy_(target)
        if out.shape[0] > bs:
            out[bs:].zero_()
