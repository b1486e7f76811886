"""Step planning of the flashinfer backend outside CUDA graphs: which wrappers a step runs and their ``plan()`` calls.

``StepPlanner`` plans an eager decode (the batch-decode wrappers, or FlashInfer's two-level cascade wrapper for a
batch with shared-prefix groups), an extend (per plan group: ragged, paged, or ragged merged with paged over the
prefix) and a verification step with draft trees (paged with a custom mask). Host work only; a graph bucket's decode
is planned by ``graph_state.DecodeGraphState``, and the backend (``backend.py``) runs what was planned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from compile_attn.attention.flashinfer.cascade import FlashInferCascadeDecode
from compile_attn.attention.flashinfer.library import FlashInferAPI
from compile_attn.attention.flashinfer.paged_indices import PagedKV, build_paged_kv
from compile_attn.attention.flashinfer.plan_groups import PlanGroup
from compile_attn.attention.flashinfer.wrappers import (
    EagerWrappers,
    PlanDTypes,
    plan_decode,
    plan_paged_prefill,
    plan_ragged,
    plan_tree_prefill,
)
from compile_attn.batch import ForwardBatch
from compile_attn.draft_tree import has_tree, verify_mask
from compile_attn.host_tensors import to_device, upload
from compile_attn.kv.cache import KVCache


@dataclass
class StepPlan:
    """What ``init_forward_metadata_out_graph`` planned for the current step."""

    is_decode: bool
    batch_size: int
    num_tokens: int  # tokens that belong to a request (padding tokens come after them)
    decode: list[Any] | None = None  # per group: the planned decode wrapper
    extend_paths: list[str] | None = None  # per group: "ragged", "paged", "cascade" or "tree"
    graph_bound: bool = False  # a graph bucket's decode: the page ids are gathered by in_graph
    filled: bool = True  # False until in_graph has gathered a graph-bound step's page ids
    cascade: list[FlashInferCascadeDecode] | None = None  # per group: a shared-prefix decode's planned wrapper


class StepPlanner:
    """Plans eager steps over the backend's eager wrappers; ``cascade_steps`` counts the eager decode steps planned
    for the cascade wrappers (tests, debugging)."""

    def __init__(self, fi: FlashInferAPI, kv_cache: KVCache, groups: list[PlanGroup], eager: EagerWrappers,
                 dtypes: PlanDTypes, workspace: torch.Tensor, extend_prefix_path: str) -> None:
        self._fi, self.kv_cache, self.groups, self._eager = fi, kv_cache, groups, eager
        self.dtypes, self.workspace, self.extend_prefix_path = dtypes, workspace, extend_prefix_path
        self.page_size, self.device = kv_cache.pool.page_size, kv_cache.device
        self._cascade: list[FlashInferCascadeDecode] | None = None
        self.cascade_steps = 0

    def decode(self, fb: ForwardBatch) -> StepPlan:
        """An eager decode step: the cascade wrappers where ``cascade`` takes the batch, else the decode wrappers."""
        cascade = self.cascade(fb)
        if cascade is not None:
            return cascade
        kv = build_paged_kv(self.kv_cache.req_to_token, fb.req_pool_indices, fb.seq_lens_cpu, self.page_size)
        wrappers = self._eager.decode
        for group, wrapper in zip(self.groups, wrappers):
            plan_decode(self._fi, wrapper, group, kv, self.page_size, self.dtypes)
        return StepPlan(is_decode=True, batch_size=fb.batch_size, num_tokens=fb.batch_size, decode=wrappers)

    def cascade(self, fb: ForwardBatch) -> StepPlan | None:
        """Plan the cascade wrappers for an eager decode batch with shared-prefix groups that end on page boundaries
        (FlashInfer reads whole pages) in a model without sliding windows; None otherwise."""
        groups = tuple(fb.shared_prefix or ())
        if not groups or any(g.uses_window for g in self.groups) or any(
                p.prefix_len % self.page_size for p in groups):
            return None
        if self._cascade is None:
            self._cascade = [FlashInferCascadeDecode(self.workspace) for _ in self.groups]
        rows = fb.req_pool_indices_cpu if fb.req_pool_indices_cpu is not None else fb.req_pool_indices.tolist()
        pairs = [(g.members, g.prefix_len) for g in groups]
        for group, wrapper in zip(self.groups, self._cascade):
            wrapper.plan(self.kv_cache.req_to_token, rows, fb.seq_lens_cpu.tolist(), pairs, page_size=self.page_size,
                         num_qo_heads=group.num_qo_heads, num_kv_heads=group.num_kv_heads, head_dim=group.head_dim,
                         sm_scale=group.sm_scale, logit_cap=group.logits_soft_cap, q_dtype=self.dtypes.q,
                         kv_dtype=self.dtypes.kv)
        self.cascade_steps += 1
        return StepPlan(is_decode=True, batch_size=fb.batch_size, num_tokens=fb.batch_size, cascade=self._cascade)

    def extend(self, fb: ForwardBatch) -> StepPlan:
        """An extend (or mixed) step: per plan group ragged (no cached prefix), paged, or cascade
        (``extend_prefix_path="cascade"``, full-attention groups); draft trees go to ``tree``."""
        ext, prefix = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        qo_indptr = torch.zeros(len(ext) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(ext, dtype=torch.int32), dim=0, out=qo_indptr[1:])
        if has_tree(fb.draft_parents):
            return self.tree(fb, qo_indptr)
        has_prefix = any(p > 0 for p in prefix)
        paths = [
            "ragged" if not has_prefix
            else "cascade" if self.extend_prefix_path == "cascade" and not group.uses_window
            else "paged"
            for group in self.groups
        ]
        full_kv = prefix_kv = None
        if "paged" in paths:
            full_kv = build_paged_kv(self.kv_cache.req_to_token, fb.req_pool_indices, fb.seq_lens_cpu, self.page_size)
        if "cascade" in paths:
            prefix_kv = build_paged_kv(self.kv_cache.req_to_token, fb.req_pool_indices, prefix, self.page_size)
        for g, (group, path) in enumerate(zip(self.groups, paths)):
            if path in ("ragged", "cascade"):
                plan_ragged(self._eager.ragged[g], group, qo_indptr, qo_indptr, self.dtypes.q)
            if path == "paged":
                self._plan_paged(g, qo_indptr, full_kv, causal=group.causal)
            elif path == "cascade":  # the prefix lies wholly before every new token: no causal mask
                self._plan_paged(g, qo_indptr, prefix_kv, causal=False)
        return StepPlan(is_decode=False, batch_size=fb.batch_size, num_tokens=int(qo_indptr[-1]), extend_paths=paths)

    def tree(self, fb: ForwardBatch, qo_indptr: torch.Tensor) -> StepPlan:
        """A verification step with draft trees: every group runs paged attention over the whole sequence (the new
        K/V are stored first) with the trees' custom mask, one mask per sliding window, uploaded in one copy."""
        kv = build_paged_kv(self.kv_cache.req_to_token, fb.req_pool_indices, fb.seq_lens_cpu, self.page_size)
        indptrs = tuple(to_device([qo_indptr, kv.indptr_cpu, kv.last_page_len_cpu], torch.int32, self.device))
        windows = list(dict.fromkeys(g.window_left + 1 if g.uses_window else None for g in self.groups))
        masks = [verify_mask(fb.extend_prefix_lens_cpu, fb.draft_parents, w) for w in windows]
        on_device = upload(torch.from_numpy(np.concatenate(masks)), self.device).split([m.size for m in masks])
        mask_of = dict(zip(windows, on_device))
        for group, wrapper in zip(self.groups, self._eager.tree):
            plan_tree_prefill(wrapper, group, indptrs, kv.indices, self.page_size, self.dtypes,
                              mask_of[group.window_left + 1 if group.uses_window else None])
        return StepPlan(is_decode=False, batch_size=fb.batch_size, num_tokens=int(qo_indptr[-1]),
                        extend_paths=["tree"] * len(self.groups))

    def _plan_paged(self, g: int, qo_indptr: torch.Tensor, kv: PagedKV | None, causal: bool) -> None:
        assert kv is not None
        plan_paged_prefill(self._eager.paged[g], self.groups[g], qo_indptr, kv, self.page_size, self.dtypes, causal)
