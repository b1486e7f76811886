"""Vocab-parallel embedding and LM head: each rank holds one contiguous slice of the (padded) vocabulary.

The vocabulary is padded up to a multiple of the tensor-parallel size (padding rows are zeros and no token id
reaches them); rank r holds rows ``[r * V_p / n, (r + 1) * V_p / n)``. The embedding looks up the ids in its slice,
zeros the others and sums over the ranks (exactly one rank contributes per token). The LM head computes its slice
of the logits and gathers them, so every rank returns the full ``[..., vocab_size]`` logits (padding dropped).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compile_attn.distributed.all_gather import all_gather_last_dim
from compile_attn.distributed.all_reduce import all_reduce
from compile_attn.distributed.partition import ShardSpec, padded_size
from compile_attn.ops.gemv import linear


def vocab_spec(vocab_size: int, rank: int, world_size: int) -> ShardSpec:
    """Rows of the (padded) vocabulary that rank ``rank`` holds."""
    per_rank = padded_size(vocab_size, world_size) // world_size
    return ShardSpec(0, rank * per_rank, per_rank, vocab_size)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of a ``vocab_size x embedding_dim`` embedding; the output is the full lookup.

    ``embed_scale``: multiply the looked-up vectors by it (Gemma's scaled embeddings), kept as a non-persistent
    buffer (a tensor is copied where it lies, so a model built with meta parameters keeps a real scale).
    """

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int,
        rank: int,
        world_size: int,
        embed_scale: float | torch.Tensor | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        spec = vocab_spec(vocab_size, rank, world_size)
        self.num_embeddings = vocab_size
        self.embedding_dim = embedding_dim
        self.vocab_start = spec.start
        self.rows = spec.length
        self.weight = nn.Parameter(torch.empty(spec.length, embedding_dim, device=device, dtype=dtype))
        self.shard_specs = {"weight": spec}
        self.embed_scale: torch.Tensor | None
        if embed_scale is None:
            self.embed_scale = None
        else:
            scale = (embed_scale.detach().clone() if isinstance(embed_scale, torch.Tensor)
                     else torch.tensor(float(embed_scale), device=device))
            self.register_buffer("embed_scale", scale, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows)
        vectors = F.embedding(local.masked_fill(outside, 0), self.weight)
        vectors = all_reduce(vectors.masked_fill(outside.unsqueeze(-1), 0.0))
        if self.embed_scale is not None:
            vectors = vectors * self.embed_scale.to(vectors.dtype)
        return vectors

    def extra_repr(self) -> str:
        return (f"rows {self.vocab_start}:{self.vocab_start + self.rows} of {self.num_embeddings}, "
                f"embedding_dim={self.embedding_dim}")


class ParallelLMHead(nn.Module):
    """This rank's vocabulary rows of a bias-free LM head; returns the full logits ``[..., vocab_size]`` on every
    rank. Tied embeddings: pass the ``VocabParallelEmbedding``'s weight as ``weight`` (the same slice)."""

    def __init__(
        self,
        embedding_dim: int,
        vocab_size: int,
        rank: int,
        world_size: int,
        weight: nn.Parameter | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        spec = vocab_spec(vocab_size, rank, world_size)
        self.in_features = embedding_dim
        self.out_features = vocab_size
        if weight is None:
            weight = nn.Parameter(torch.empty(spec.length, embedding_dim, device=device, dtype=dtype))
        elif tuple(weight.shape) != (spec.length, embedding_dim):
            raise ValueError(f"a tied LM head weight must be this rank's [{spec.length}, {embedding_dim}] vocabulary "
                             f"slice, got {tuple(weight.shape)}")
        self.weight = weight
        self.shard_specs = {"weight": spec}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last_dim(linear(hidden, self.weight))
        return logits if logits.shape[-1] == self.out_features else logits[..., : self.out_features]

    def extra_repr(self) -> str:
        spec = self.shard_specs["weight"]
        return f"in_features={self.in_features}, rows {spec.start}:{spec.stop} of vocab_size={self.out_features}"
