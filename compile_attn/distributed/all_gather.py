"""``torch.ops.compile_attn.tp_all_gather``: every rank's slice of the last dimension, concatenated in rank order.

A functional custom op with a fake implementation (the parallel LM head's logits go through it), traced by Dynamo
like ``tp_all_reduce`` and, like it, not a split op. ``all_gather_last_dim`` is what model code calls: the input
itself at size 1.
"""

from __future__ import annotations

import torch

from compile_attn.distributed.state import resolve_group, tp_group_name, tp_size


@torch.library.custom_op("compile_attn::tp_all_gather", mutates_args=())
def tp_all_gather(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """``[..., world_size * n]`` from every rank's ``x[..., n]`` of the group ``group_name``, rank 0's first."""
    if not group_name:
        return x.clone(memory_format=torch.contiguous_format)
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x, group=resolve_group(group_name))
    return torch.cat(parts, dim=-1)


@tp_all_gather.register_fake
def _tp_all_gather_fake(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], x.shape[-1] * (world_size if group_name else 1))


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """The tensor-parallel ranks' ``x`` concatenated along the last dimension; ``x`` itself at size 1."""
    size = tp_size()
    if size == 1:
        return x
    return torch.ops.compile_attn.tp_all_gather(x, tp_group_name(), size)
