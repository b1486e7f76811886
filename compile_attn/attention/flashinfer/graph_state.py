"""CUDA-graph decode: static page-CSR buffers and one ``use_cuda_graph=True`` wrapper per bucket and group.

A captured graph bakes in the buffer addresses, so every bucket's wrappers read ``indptr[:bs+1]``,
``last_page_len[:bs]`` and ``indices`` of the same static buffers, and the wrappers of one group share
one int workspace (only one bucket's plan is live at a time; FlashInfer keeps the plan layout fixed
per batch size in graph mode). Before each replay the buffers are refilled and the bucket re-planned,
outside the graph.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from compile_attn.attention.flashinfer.library import FlashInferAPI
from compile_attn.attention.flashinfer.paged_indices import build_paged_kv
from compile_attn.attention.flashinfer.plan_groups import PlanGroup
from compile_attn.attention.flashinfer.wrappers import PlanDTypes, plan_decode
from compile_attn.host_tensors import upload

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
        self.indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.last_page_len = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.indices = torch.zeros(max_bs * pages_per_request, dtype=torch.int32, device=device)
        self._int_workspaces = [
            torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device) for _ in self.groups
        ]
        self._wrappers: dict[int, list[Any]] = {}
        self._planned: set[int] = set()

    @property
    def num_buckets(self) -> int:
        return len(self._wrappers)

    def wrappers(self, bs: int) -> list[Any]:
        """The bucket's wrappers (one per group), created on first use."""
        if bs not in self._wrappers:
            made = []
            for g, tc in enumerate(self.tensor_cores):
                wrapper = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.float_workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tc,
                    paged_kv_indptr_buffer=self.indptr[: bs + 1],
                    paged_kv_indices_buffer=self.indices,
                    paged_kv_last_page_len_buffer=self.last_page_len[:bs],
                )
                wrapper.reset_workspace_buffer(self.float_workspace, self._int_workspaces[g])
                made.append(wrapper)
            self._wrappers[bs] = made
        return self._wrappers[bs]

    def plan(
        self, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens_cpu: torch.Tensor,
        dtypes: PlanDTypes,
    ) -> list[Any]:
        """Fill the static buffers with the batch's page CSR and plan every group's wrapper of its bucket."""
        bs = int(seq_lens_cpu.shape[0])  # the caller checked it fits (AttentionBackend.check_graph_view)
        wrappers = self.wrappers(bs)
        kv = build_paged_kv(req_to_token, req_pool_indices, seq_lens_cpu, self.page_size,
                            indptr_out=self.indptr, indices_out=self.indices)
        self.last_page_len[:bs].copy_(upload(kv.last_page_len_cpu, self.indices.device), non_blocking=True)
        # fast_decode_plan reads the buffers as they are; a wrapper's first plan must be the full one
        fast = self.fast_plan and bs in self._planned
        for group, wrapper in zip(self.groups, wrappers):
            plan_decode(self.fi, wrapper, group, kv, self.page_size, dtypes, fast=fast)
        self._planned.add(bs)
        return wrappers
