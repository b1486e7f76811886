"""The eager FlashInfer wrappers (one decode, paged-prefill and ragged-prefill wrapper per plan group)
and the ``plan()`` calls that fill them.

All wrappers share one float workspace (split-KV partial results; runs are stream-ordered, so one
buffer serves every wrapper). Plans take host ``indptr``/``last_page_len`` and device page ids, so
planning reads no device memory. Nothing here runs inside a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from compile_attn.attention.flashinfer.library import FlashInferAPI
from compile_attn.attention.flashinfer.paged_indices import PagedKV
from compile_attn.attention.flashinfer.plan_groups import PlanGroup


@dataclass(frozen=True)
class PlanDTypes:
    """Query and KV-cache dtypes a plan is made for (FlashInfer picks its kernel by them)."""

    q: torch.dtype
    kv: torch.dtype


def _common_kwargs(group: PlanGroup) -> dict[str, Any]:
    return dict(
        window_left=group.window_left,
        logits_soft_cap=group.logits_soft_cap,
        sm_scale=group.sm_scale,
        non_blocking=True,
    )


def plan_decode(
    fi: FlashInferAPI,
    wrapper: Any,
    group: PlanGroup,
    kv: PagedKV,
    page_size: int,
    dtypes: PlanDTypes,
    fast: bool = False,
) -> None:
    """Plan one decode step; ``fast`` uses flashinfer's ``fast_decode_plan`` (graph wrappers only:
    it expects the static buffers to be filled already and the wrapper to have been planned once)."""
    args = (kv.indptr_cpu, kv.indices, kv.last_page_len_cpu, group.num_qo_heads, group.num_kv_heads,
            group.head_dim, page_size)
    kwargs = dict(pos_encoding_mode="NONE", q_data_type=dtypes.q, kv_data_type=dtypes.kv, **_common_kwargs(group))
    if fast:
        assert fi.fast_decode_plan is not None
        fi.fast_decode_plan(wrapper, *args, **kwargs)
    else:
        wrapper.plan(*args, **kwargs)


def plan_paged_prefill(
    wrapper: Any,
    group: PlanGroup,
    qo_indptr_cpu: torch.Tensor,
    kv: PagedKV,
    page_size: int,
    dtypes: PlanDTypes,
    causal: bool,
) -> None:
    """Queries ``qo_indptr`` over the paged KV ``kv``; FlashInfer aligns each request's queries to the
    end of its KV, so query i of a request with q_len Lq and kv_len Lk sits at position Lk - Lq + i."""
    wrapper.plan(
        qo_indptr_cpu, kv.indptr_cpu, kv.indices, kv.last_page_len_cpu,
        group.num_qo_heads, group.num_kv_heads, group.head_dim, page_size,
        head_dim_vo=group.head_dim, causal=causal, q_data_type=dtypes.q, kv_data_type=dtypes.kv,
        **_common_kwargs(group),
    )


def plan_tree_prefill(
    wrapper: Any,
    group: PlanGroup,
    indptrs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    kv_indices: torch.Tensor,
    page_size: int,
    dtypes: PlanDTypes,
    custom_mask: torch.Tensor,
) -> None:
    """Queries over the paged KV with a custom mask (a verification step's draft trees): ``indptrs`` are the
    device ``(qo_indptr, paged_kv_indptr, last_page_len)``, ``custom_mask`` the device bool mask, flattened
    ``[q_len, kv_len]`` per request. The window is in the mask (``window_left`` -1): FlashInfer's window counts
    table positions, a tree's counts rotary ones. FlashInfer 0.5.3 packs the mask on the device with the indptrs
    beside it (its ``segment_packbits`` refuses host indptrs), and plan() reads the indptrs back to the host: a
    device sync."""
    qo_indptr, kv_indptr, last_page_len = indptrs
    wrapper.plan(
        qo_indptr, kv_indptr, kv_indices, last_page_len,
        group.num_qo_heads, group.num_kv_heads, group.head_dim, page_size,
        head_dim_vo=group.head_dim, custom_mask=custom_mask, q_data_type=dtypes.q, kv_data_type=dtypes.kv,
        **{**_common_kwargs(group), "window_left": -1},
    )


def plan_ragged(
    wrapper: Any, group: PlanGroup, qo_indptr_cpu: torch.Tensor, kv_indptr_cpu: torch.Tensor, q_dtype: torch.dtype
) -> None:
    """Attention of the new tokens over themselves (K/V from the step's tensors, in the query dtype)."""
    wrapper.plan(
        qo_indptr_cpu, kv_indptr_cpu, group.num_qo_heads, group.num_kv_heads, group.head_dim,
        head_dim_vo=group.head_dim, causal=group.causal, q_data_type=q_dtype, kv_data_type=q_dtype,
        **_common_kwargs(group),
    )


class EagerWrappers:
    """Per plan group: a decode wrapper, a paged-prefill wrapper and a ragged-prefill wrapper; and, made on first
    use, a paged-prefill wrapper on FlashInfer's fa2 backend (the one with custom masks) for draft trees."""

    def __init__(
        self,
        fi: FlashInferAPI,
        groups: Sequence[PlanGroup],
        tensor_cores: Sequence[bool],
        float_workspace: torch.Tensor,
        prefill_backend: str,
    ) -> None:
        self.decode = [
            fi.BatchDecodeWithPagedKVCacheWrapper(float_workspace, "NHD", use_tensor_cores=tc) for tc in tensor_cores
        ]
        self.paged = [
            fi.BatchPrefillWithPagedKVCacheWrapper(float_workspace, "NHD", backend=prefill_backend) for _ in groups
        ]
        self.ragged = [
            fi.BatchPrefillWithRaggedKVCacheWrapper(float_workspace, "NHD", backend=prefill_backend) for _ in groups
        ]
        self._fi, self._workspace, self._num_groups = fi, float_workspace, len(groups)
        self._tree: list[Any] | None = None

    @property
    def tree(self) -> list[Any]:
        """Per plan group: the paged-prefill wrapper that verifies draft trees (fa2: custom masks)."""
        if self._tree is None:
            self._tree = [self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2")
                          for _ in range(self._num_groups)]
        return self._tree


def run_into(out: torch.Tensor, fn: Callable[[torch.Tensor], object], dtype: torch.dtype) -> None:
    """Call ``fn(o)`` so that it writes ``o``; ``o`` is ``out`` itself when FlashInfer can write it directly
    (contiguous, the query dtype), else a temporary copied into ``out`` afterwards."""
    if out.is_contiguous() and out.dtype == dtype:
        fn(out)
        return
    tmp = torch.empty(out.shape, dtype=dtype, device=out.device)
    fn(tmp)
    out.copy_(tmp)
