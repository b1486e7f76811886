"""CUDA-graph decode: static page-CSR buffers and one ``use_cuda_graph=True`` wrapper per bucket and group.

A captured graph bakes in the buffer addresses, so every bucket's wrappers read the same static buffers
(one group's wrappers also share one int workspace: only one bucket's plan is live at a time; FlashInfer
keeps the plan layout fixed per batch size in graph mode). A bucket of ``bs`` requests reads
``meta[:bs+1]`` as ``indptr`` and ``meta[bs+1:2bs+1]`` as ``last_page_len``, so that the host CSR goes to the
device in one copy. Before each replay ``plan`` uploads it and re-plans the bucket (host work, outside the
graph); the page ids are gathered from ``req_to_token`` by ``gather``, one kernel recorded in the graph.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from compile_attn.attention.flashinfer.library import FlashInferAPI
from compile_attn.attention.flashinfer.paged_indices import PagedKV, page_csr
from compile_attn.attention.flashinfer.plan_groups import PlanGroup
from compile_attn.attention.flashinfer.wrappers import PlanDTypes, plan_decode
from compile_attn.host_tensors import upload_into

logger = logging.getLogger(__name__)

INT_WORKSPACE_BYTES = 8 * 1024 * 1024  # what flashinfer allocates per wrapper


class DecodeGraphState:
    """Static buffers for decode graphs of up to ``max_bs`` requests of up to ``max_context`` tokens."""

    def __init__(
        self,
        fi: FlashInferAPI,
        groups: Sequence[PlanGroup],
        tensor_cores: Sequence[bool],
        float_workspace: torch.Tensor,
        *,
        max_bs: int,
        max_context: int,
        page_size: int,
        fast_plan: bool,
    ) -> None:
        device = float_workspace.device
        self.fi = fi
        self.groups = list(groups)
        self.tensor_cores = list(tensor_cores)
        self.float_workspace = float_workspace
        self.max_bs = max_bs
        self.max_context = max_context
        self.page_size = page_size
        self.fast_plan = fast_plan and fi.fast_decode_plan is not None
        pages_per_request = -(-max_context // page_size)
        self.meta = torch.zeros(2 * max_bs + 1, dtype=torch.int32, device=device)  # per bucket: [indptr | last]
        self.indices = torch.zeros(max_bs * pages_per_request, dtype=torch.int32, device=device)
        self._int_workspaces = [
            torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device) for _ in self.groups
        ]
        self._wrappers: dict[int, list[Any]] = {}
        self._planned: set[int] = set()
        self._live_bs: int | None = None  # the bucket of the last plan: what gather fills

    def wrappers(self, bs: int) -> list[Any]:
        """The bucket's wrappers (one per group), created on first use."""
        if bs not in self._wrappers:
            made = []
            for g, tc in enumerate(self.tensor_cores):
                wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.float_workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tc,
                    paged_kv_indptr_buffer=self.indptr(bs),
                    paged_kv_indices_buffer=self.indices,
                    paged_kv_last_page_len_buffer=self.meta[bs + 1 : 2 * bs + 1],
                )
                wrapper.reset_workspace_buffer(self.float_workspace, self._int_workspaces[g])
                made.append(wrapper)
            self._wrappers[bs] = made
        return self._wrappers[bs]

    def indptr(self, bs: int) -> torch.Tensor:
        """The device page ``indptr`` of bucket ``bs`` (filled by ``plan``)."""
        return self.meta[: bs + 1]

    def plan(self, seq_lens_cpu: torch.Tensor, dtypes: PlanDTypes) -> list[Any]:
        """Upload the batch's host CSR into the bucket's part of ``meta`` and plan every group's wrapper of the
        bucket. The page ids are not written here: ``gather`` does that, inside the graph."""
        bs = int(seq_lens_cpu.shape[0])  # the caller checked it fits (AttentionBackend.check_graph_view)
        wrappers = self.wrappers(bs)
        csr = page_csr(seq_lens_cpu, self.page_size)
        total = csr.total_pages
        if total > self.indices.numel():
            raise ValueError(f"{total} pages do not fit the {self.indices.numel()}-entry page-index buffer")
        upload_into(self.meta[: 2 * bs + 1], csr.packed)
        kv = PagedKV(indptr_cpu=csr.indptr, indices=self.indices[:total], last_page_len_cpu=csr.last_page_len)
        # fast_decode_plan reads the buffers as they are; a wrapper's first plan must be the full one
        fast = self.fast_plan and bs in self._planned
        for group, wrapper in zip(self.groups, wrappers):
            plan_decode(self.fi, wrapper, group, kv, self.page_size, dtypes, fast=fast)
        self._planned.add(bs)
        self._live_bs = bs
        return wrappers

    def gather(self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor) -> None:
        """The page ids of the planned bucket (``len(req_pool_indices)`` requests) into ``indices``: one launch,
        static shapes, no host sync (recordable in the graph)."""
        from compile_attn.attention.kernels import build_page_indices

        bs = req_pool_indices.shape[0]
        if bs != self._live_bs:
            raise ValueError(f"gather got {bs} request rows but the last plan was for a bucket of {self._live_bs}")
        build_page_indices(req_to_token, req_pool_indices, self.indptr(bs), self.indices, self.page_size)
