"""The tensor-parallel group of this process: its rank, its size and the torch.distributed process group.

``init_tensor_parallel`` sets it once per process (NCCL on CUDA, gloo on the CPU; ``env://`` by default, as
torchrun sets it up); ``destroy_tensor_parallel`` ends it. At size 1 nothing of torch.distributed is needed and
every accessor works before any initialisation. This module owns no collective and no model code.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from compile_attn.errors import InvalidConfigError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallelState:
    """``group`` is None at size 1 and ``group_name`` its registered name (the collective ops' argument, "" at
    size 1); ``owns_process_group``: ``init_tensor_parallel`` started torch.distributed (so
    ``destroy_tensor_parallel`` ends it). ``host_group`` carries host-side messages (the engine's step metadata)
    between the ranks' processes without touching a device stream: a gloo group over the same ranks next to an NCCL
    ``group`` (with no timeout of its own: a worker waits in it for as long as rank 0 is idle), ``group`` itself on
    gloo."""

    rank: int = 0
    world_size: int = 1
    group: ProcessGroup | None = None
    group_name: str = ""
    owns_process_group: bool = False
    host_group: ProcessGroup | None = None


_STATE = TensorParallelState()
HOST_GROUP_TIMEOUT = datetime.timedelta(days=365)  # a worker waits for rank 0's next step while the engine idles


def _env_int(name: str, given: int | None) -> int | None:
    if given is not None:
        return given
    value = os.environ.get(name)
    return None if value is None else int(value)


def default_backend() -> str:
    """``"nccl"`` where CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_tensor_parallel(
    rank: int | None = None,
    world_size: int | None = None,
    backend: str | None = None,
    init_method: str | None = None,
    timeout_s: float | None = None,
) -> TensorParallelState:
    """Make this process rank ``rank`` of a tensor-parallel group of ``world_size`` processes.

    ``rank`` / ``world_size`` default to the ``RANK`` / ``WORLD_SIZE`` environment variables (torchrun sets them),
    else 0 / 1. At ``world_size`` 1 no process group is created. Otherwise torch.distributed is initialised with
    ``backend`` (default: nccl on CUDA, gloo on the CPU) and ``init_method`` (default ``"env://"``, which reads
    ``MASTER_ADDR`` / ``MASTER_PORT``), unless it already is, in which case its world must be this group. The
    tensor-parallel group is the whole world. ``timeout_s`` bounds every collective (a dead peer gives an error,
    not a hang). On CUDA the process's device is set to ``LOCAL_RANK`` (default: rank modulo the device count).
    """
    global _STATE
    rank = _env_int("RANK", rank)
    rank = 0 if rank is None else rank
    world_size = _env_int("WORLD_SIZE", world_size)
    world_size = 1 if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidConfigError(
            f"tensor parallel rank {rank} of world_size {world_size}: need world_size >= 1 and 0 <= rank < "
            f"world_size (set RANK / WORLD_SIZE or pass rank= and world_size=)"
        )
    if _STATE.world_size > 1:
        raise InvalidConfigError(
            f"tensor parallelism is already initialised (rank {_STATE.rank} of {_STATE.world_size}); call "
            f"destroy_tensor_parallel() first"
        )
    if world_size == 1:
        _STATE = TensorParallelState()
        return _STATE
    import torch.distributed as dist

    backend = backend or default_backend()
    if backend == "nccl":
        local_rank = _env_int("LOCAL_RANK", None)
        torch.cuda.set_device(local_rank if local_rank is not None else rank % torch.cuda.device_count())
    owns = not dist.is_initialized()
    if owns:
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
                                timeout=timeout)
    elif (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        raise InvalidConfigError(
            f"torch.distributed is already initialised as rank {dist.get_rank()} of {dist.get_world_size()}, but "
            f"tensor parallelism was asked for rank {rank} of {world_size}; pass the process group's own values"
        )
    group = dist.group.WORLD
    assert group is not None  # initialised above
    host_group = group
    if dist.get_backend(group) != "gloo":  # every rank creates it here, in the same order
        host_group = dist.new_group(backend="gloo", timeout=HOST_GROUP_TIMEOUT)
    _STATE = TensorParallelState(rank, world_size, group, group.group_name, owns, host_group)
    logger.info("tensor parallel: rank %d of %d (%s)", rank, world_size, dist.get_backend())
    return _STATE


def destroy_tensor_parallel() -> None:
    """Back to size 1; ends the process group if ``init_tensor_parallel`` started it. An NCCL group is aborted
    (each rank frees its communicators without waiting for the others; graceful destruction of an NCCL group can
    wait on a peer that already left), a gloo one destroyed. The fast all-reduce's buffers are released first."""
    global _STATE
    from compile_attn.distributed.lamport_all_reduce import release_lamport_all_reduce

    release_lamport_all_reduce()
    state, _STATE = _STATE, TensorParallelState()
    if state.owns_process_group:
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        else:
            dist.destroy_process_group()


def tp_state() -> TensorParallelState:
    return _STATE


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.world_size


def tp_group() -> ProcessGroup | None:
    """The process group (None at size 1)."""
    return _STATE.group


def tp_host_group() -> ProcessGroup | None:
    """The group for host-side messages (None at size 1; see ``TensorParallelState``)."""
    return _STATE.host_group


def tp_group_name() -> str:
    """The process group's registered name, which the collective ops take ("" at size 1)."""
    return _STATE.group_name


def resolve_group(group_name: str) -> ProcessGroup:
    """The tensor-parallel process group named ``group_name`` (what a collective op was traced with)."""
    group = _STATE.group
    if group is None or _STATE.group_name != group_name:
        raise RuntimeError(
            f"no tensor-parallel process group named {group_name!r} in this process (current: "
            f"{tp_group_name()!r}); call init_tensor_parallel(...) before running a sharded model"
        )
    return group
