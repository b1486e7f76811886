"""How one rank's parameter maps onto the full (unsharded) tensor: ``ShardSpec`` and the code that cuts it out.

A sharded module names, per parameter, the dimension it is split on and the full-tensor range it holds; the same
``read_shard`` cuts that range from a full in-memory tensor or from a safetensors slice (reading only those
bytes), zero-filling rows past the full size (vocabulary padding). Parameters without a spec are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from compile_attn.errors import UnsupportedConfigError


@dataclass(frozen=True)
class ShardSpec:
    """Local index ``i`` along ``dim`` is full index ``start + i``, for ``length`` entries; full indices at or past
    ``full_size`` (padding) are zeros."""

    dim: int
    start: int
    length: int
    full_size: int

    @property
    def stop(self) -> int:
        return self.start + self.length


def even_range(size: int, rank: int, world_size: int, what: str, way_out: str) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank`` when ``size`` splits evenly over ``world_size`` ranks (else an error that
    names ``what`` and ``way_out``)."""
    if size % world_size:
        raise UnsupportedConfigError(
            f"{what} {size} is not divisible by tensor_parallel_size {world_size}; {way_out}"
        )
    per = size // world_size
    return rank * per, (rank + 1) * per


def padded_size(size: int, world_size: int) -> int:
    """``size`` rounded up to a multiple of ``world_size``."""
    return -(-size // world_size) * world_size


def _full_shape(source: Any) -> list[int]:
    return list(source.shape) if isinstance(source, torch.Tensor) else list(source.get_shape())


def read_shard(source: Any, spec: ShardSpec | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """This rank's part of ``source`` (a full tensor, or a safetensors ``get_slice`` object: only the part is read).

    ``spec`` None: all of it (a replicated parameter). The result owns its memory (never a view of ``source``).
    """
    if spec is None:
        out = source.clone() if isinstance(source, torch.Tensor) else source[:]
        return out if dtype is None else out.to(dtype)
    shape = _full_shape(source)
    if shape[spec.dim] != spec.full_size:
        raise UnsupportedConfigError(
            f"a tensor of shape {shape} has {shape[spec.dim]} entries along dim {spec.dim}, but the sharded "
            f"parameter expects {spec.full_size}; the checkpoint does not match the model's config"
        )
    stop = min(spec.stop, spec.full_size)
    start = min(spec.start, stop)  # a rank holding padding only reads nothing
    index = (slice(None),) * spec.dim + (slice(start, stop),)
    part = source[index]
    if isinstance(part, torch.Tensor) and isinstance(source, torch.Tensor):
        part = part.clone()
    if dtype is not None:
        part = part.to(dtype)
    missing = spec.length - (stop - start)
    if missing > 0:
        pad_shape = list(part.shape)
        pad_shape[spec.dim] = missing
        part = torch.cat([part, part.new_zeros(pad_shape)], dim=spec.dim)
    return part


def copy_shards(module: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Replace each direct parameter of ``module`` by its shard of ``full[name]`` (``module.shard_specs`` names the
    split ones; the others are copied whole). Works on meta tensors too (the shards stay meta)."""
    specs: dict[str, ShardSpec] = getattr(module, "shard_specs", {})
    for name, param in list(module.named_parameters(recurse=False)):
        data = read_shard(full[name].detach(), specs.get(name))
        setattr(module, name, torch.nn.Parameter(data, requires_grad=param.requires_grad))
