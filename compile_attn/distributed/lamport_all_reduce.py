"""The fast path of the tensor-parallel sum for small messages: FlashInfer's Lamport all-reduce
(``flashinfer.comm.trtllm_allreduce_fusion`` with the plain all-reduce pattern: one-shot, or two-shot for larger
messages) over CUDA IPC buffers that every rank of the group maps.

NCCL costs ~8 us per message inside a CUDA graph at a decode step's sizes, most of it latency; this kernel writes
each rank's part into every peer's buffer and polls for theirs (no multicast, no NVLS), 2.5x faster at a decode
step's sizes (``benchmarks/bench_tensor_parallel.py fused``; docs/tensor_parallel.md has the table). A Llama-3.1-8B
decode step makes 64 such sums.

``setup_lamport_all_reduce`` is collective: every rank calls it at the same point of its start-up, after the model
is loaded and before the KV cache is sized (the buffers take device memory outside torch's allocator). The ranks
first agree that every one of them can run the kernel (FlashInfer importable, its kernels built, the dtype and
world size supported), so that either all ranks take the fast path or none does. ``lamport_all_reduce`` is what the
``tp_all_reduce`` op calls: it returns None for a message that does not fit (more tokens than the buffers hold,
another hidden size or dtype, a CPU tensor), and the op then falls back to NCCL, which every rank does alike since
the ranks run the same shapes. ``release_lamport_all_reduce`` frees this rank's buffers without a collective.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

SUPPORTED_WORLD_SIZES = (2, 4, 8)  # FlashInfer's one-shot heuristics and kernels exist for these
DEFAULT_MAX_TOKENS = 2048  # a decode step of 256 rows x verify tokens fits, as do the extend graphs' sizes


@dataclass(frozen=True)
class LamportWorkspace:
    """The mapped buffers of one process group: pointers of every rank's buffers on the device (``ptrs``) and the
    shape they were sized for."""

    group_name: str
    rank: int
    world_size: int
    hidden: int
    max_tokens: int
    dtype: torch.dtype
    handles: list[list[int]]  # per buffer, each rank's device pointer (this rank's own allocation at [rank])
    ptrs: torch.Tensor
    comm: Any  # flashinfer.comm, its kernels loaded


_WORKSPACE: LamportWorkspace | None = None


def active_workspace() -> LamportWorkspace | None:
    return _WORKSPACE


def _flashinfer_comm() -> Any:
    """``flashinfer.comm`` with its all-reduce kernels built and loaded (the first use builds them)."""
    import flashinfer.comm as comm
    from flashinfer.comm.trtllm_ar import get_trtllm_comm_module

    get_trtllm_comm_module()
    return comm


def _why_not(world_size: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why this rank cannot take the fast path (None: it can)."""
    if device.type != "cuda":
        return "not on CUDA"
    if world_size not in SUPPORTED_WORLD_SIZES:
        return f"world size {world_size} (FlashInfer's kernel takes {SUPPORTED_WORLD_SIZES})"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype} (bfloat16 / float16 only)"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "a GPU older than Hopper"
    try:
        logger.info("tensor parallel: loading FlashInfer's all-reduce kernels (built on first use, then cached)")
        _flashinfer_comm()
    except Exception as exc:  # noqa: BLE001  (any failure means NCCL, on every rank)
        return f"FlashInfer's all-reduce is unavailable ({type(exc).__name__}: {exc})"
    return None


def setup_lamport_all_reduce(group: Any, group_name: str, rank: int, world_size: int, hidden: int,
                             max_tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Map the buffers for messages of up to ``max_tokens`` x ``hidden`` on every rank of ``group`` (collective);
    returns whether the fast path is on. When any rank cannot take it, none does (logged with the reason)."""
    global _WORKSPACE
    import torch.distributed as dist

    release_lamport_all_reduce()
    reason = _why_not(world_size, dtype, device)
    able = torch.tensor([0 if reason else 1], dtype=torch.int32, device=device)
    dist.all_reduce(able, op=dist.ReduceOp.MIN, group=group)
    if not int(able.item()):
        logger.info("tensor parallel: all-reduce through NCCL (%s)", reason or "another rank cannot use FlashInfer's")
        return False
    comm = _flashinfer_comm()
    with contextlib.redirect_stdout(io.StringIO()) as said:  # FlashInfer prints each pointer it maps
        handles, ptrs = comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(
            rank, world_size, max_tokens, hidden, use_fp32_lamport=False, group=group)
    logger.debug("FlashInfer workspace: %s", said.getvalue())
    _WORKSPACE = LamportWorkspace(group_name, rank, world_size, hidden, max_tokens, dtype, handles, ptrs, comm)
    logger.info("tensor parallel: all-reduce of up to %d x %d through FlashInfer's Lamport kernel, NCCL above",
                max_tokens, hidden)
    return True


def lamport_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor | None:
    """The sum of ``x`` over the group through the mapped buffers, or None where ``x`` does not fit them."""
    ws = _WORKSPACE
    if ws is None or ws.group_name != group_name or not x.is_cuda or x.dtype != ws.dtype or not x.numel():
        return None
    if x.shape[-1] != ws.hidden or x.numel() // ws.hidden > ws.max_tokens:
        return None
    tokens = x.numel() // ws.hidden
    inp = x.reshape(tokens, ws.hidden).contiguous()
    out = torch.empty_like(inp)
    comm = ws.comm
    comm.trtllm_allreduce_fusion(
        allreduce_in=inp, world_size=ws.world_size, world_rank=ws.rank, token_num=tokens, hidden_dim=ws.hidden,
        workspace_ptrs=ws.ptrs, launch_with_pdl=False, trigger_completion_at_end=True, fp32_acc=True,
        pattern_code=comm.AllReduceFusionPattern.kAllReduce, use_oneshot=None, allreduce_out=out,
        residual_in=None, residual_out=None, norm_out=None, quant_out=None, scale_out=None, rms_gamma=None,
        rms_eps=None, scale_factor=None, layout_code=None)
    return out.view(x.shape)


def release_lamport_all_reduce() -> None:
    """Forget the buffers: unmap the peers' and free this rank's own (no collective: a peer may be gone). Call it
    after the last all-reduce of every rank (at shutdown)."""
    global _WORKSPACE
    ws, _WORKSPACE = _WORKSPACE, None
    if ws is None:
        return
    try:
        from flashinfer.comm.cuda_ipc import cudart

        torch.cuda.synchronize()
        for pointers in ws.handles:
            for r, ptr in enumerate(pointers):
                if r == ws.rank:
                    cudart.cudaFree(ctypes.c_void_p(ptr))
                elif cudart.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)) != 0:
                    raise RuntimeError(f"cudaIpcCloseMemHandle failed on rank {r}'s buffer")
    except Exception as exc:  # noqa: BLE001  (the process's exit frees them too)
        logger.warning("tensor parallel: FlashInfer's all-reduce buffers were not freed (%s)", exc)
