"""``torch.ops.compile_attn.tp_all_reduce``: the tensor-parallel sum as a functional custom op, and ``all_reduce``.

The op returns a new tensor (the sum over the group's ranks) and has a fake implementation, so Dynamo traces it
into one graph with a dynamic token count. It is deliberately not a split op: the compile backend keeps it inside
the compiled pieces (and a full graph captures it), unlike attention. ``all_reduce`` is what model code calls: the
input itself at size 1, the op otherwise.
"""

from __future__ import annotations

import torch

from compile_attn.distributed.lamport_all_reduce import lamport_all_reduce
from compile_attn.distributed.state import resolve_group, tp_group_name, tp_size


@torch.library.custom_op("compile_attn::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of ``x`` over the ranks of the process group ``group_name`` ("" = one rank: a copy of ``x``)."""
    if group_name and (fast := lamport_all_reduce(x, group_name)) is not None:
        return fast
    out = x.clone(memory_format=torch.contiguous_format)
    if group_name:
        import torch.distributed as dist

        dist.all_reduce(out, group=resolve_group(group_name))
    return out


@tp_all_reduce.register_fake
def _tp_all_reduce_fake(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over the tensor-parallel group; ``x`` itself (no op, no copy) at size 1."""
    if tp_size() == 1:
        return x
    return torch.ops.compile_attn.tp_all_reduce(x, tp_group_name())
