"""Column- and row-parallel linear layers: one rank's slice of a full ``nn.Linear``.

Column-parallel holds a range of output features (q/k/v, gate/up): its output is this rank's part, no collective.
Row-parallel holds a range of input features (o, down): each rank's partial product is summed with
``all_reduce`` and the bias, held whole on every rank, is added once after the sum. ``shard_specs`` tells the
loaders which full-tensor range each parameter holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compile_attn.distributed.all_reduce import all_reduce
from compile_attn.distributed.partition import ShardSpec, copy_shards


class ColumnParallelLinear(nn.Module):
    """Output features ``[out_start, out_stop)`` of a linear ``full_out_features x in_features`` layer."""

    def __init__(
        self,
        in_features: int,
        full_out_features: int,
        out_start: int,
        out_stop: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_stop - out_start
        self.full_out_features = full_out_features
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.out_features, device=device, dtype=dtype)) if bias else None
        spec = ShardSpec(0, out_start, self.out_features, full_out_features)
        self.shard_specs = {"weight": spec, "bias": spec}

    @classmethod
    def from_linear(cls, linear: nn.Linear, out_start: int, out_stop: int) -> ColumnParallelLinear:
        """The slice of ``linear`` (its tensors are copied, so the full layer can be freed; meta stays meta)."""
        module = cls(linear.in_features, linear.out_features, out_start, out_stop, linear.bias is not None,
                     device="meta", dtype=linear.weight.dtype)
        copy_shards(module, dict(linear.named_parameters(recurse=False)))
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        spec = self.shard_specs["weight"]
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(rows {spec.start}:{spec.stop} of {spec.full_size}), bias={self.bias is not None}")


class RowParallelLinear(nn.Module):
    """Input features ``[in_start, in_stop)`` of a linear layer; the output is summed over the ranks."""

    def __init__(
        self,
        full_in_features: int,
        out_features: int,
        in_start: int,
        in_stop: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_stop - in_start
        self.full_in_features = full_in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.shard_specs = {"weight": ShardSpec(1, in_start, self.in_features, full_in_features)}

    @classmethod
    def from_linear(cls, linear: nn.Linear, in_start: int, in_stop: int) -> RowParallelLinear:
        module = cls(linear.in_features, linear.out_features, in_start, in_stop, linear.bias is not None,
                     device="meta", dtype=linear.weight.dtype)
        copy_shards(module, dict(linear.named_parameters(recurse=False)))
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        spec = self.shard_specs["weight"]
        return (f"in_features={self.in_features} (columns {spec.start}:{spec.stop} of {spec.full_size}), "
                f"out_features={self.out_features}, bias={self.bias is not None}")
