"""``shard_model``: rewrite an HF causal LM of a supported family, in place, into one tensor-parallel rank's part.

q/k/v and gate/up become column-parallel, o and down row-parallel, the embedding vocab-parallel and the LM head a
parallel LM head (tied embeddings stay tied). Each rank holds ``num_attention_heads / n`` query heads and the KV
heads those use: ``num_key_value_heads / n`` of them, or one replicated KV head when there are fewer KV heads than
ranks. The config's head counts and ``intermediate_size`` become the per-rank values, so the HF forward reshapes
with local heads and ``compile_attn.hf.attention_layers(model)`` (hence KV cache sizing and the attention backends)
sees per-rank heads; the global sizes are kept in ``model.compile_attn_tp_plan``. The vocabulary is padded up to a
multiple of ``n`` (zero rows; the logits stay ``[..., vocab_size]``). Needs no process group: only forward does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from compile_attn.distributed.embedding import ParallelLMHead, VocabParallelEmbedding
from compile_attn.distributed.linear import ColumnParallelLinear, RowParallelLinear
from compile_attn.distributed.partition import padded_size, read_shard
from compile_attn.errors import InvalidConfigError, UnsupportedConfigError
from compile_attn.hf.families import check_supported

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallelPlan:
    """One rank's part of a model: global sizes, and the query / KV head ranges ``[start, stop)`` this rank holds."""

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]

    @property
    def local_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def local_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def padded_vocab_size(self) -> int:
        return padded_size(self.vocab_size, self.world_size)


def _fits(num_heads: int, num_kv_heads: int, intermediate: int, world_size: int) -> bool:
    kv_ok = num_kv_heads % world_size == 0 or world_size % num_kv_heads == 0
    return num_heads % world_size == 0 and intermediate % world_size == 0 and kv_ok


def plan_for(config: Any, rank: int, world_size: int) -> TensorParallelPlan:
    """The sharding of ``config`` for rank ``rank`` of ``world_size``, or an error naming the value that does not
    split and the tensor-parallel sizes that would work."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidConfigError(f"rank {rank} of tensor_parallel_size {world_size}: need 0 <= rank < size")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    inter = config.intermediate_size
    if not _fits(heads, kv_heads, inter, world_size):
        sizes = [n for n in range(1, heads + 1) if _fits(heads, kv_heads, inter, n)]
        if heads % world_size:
            problem = f"num_attention_heads {heads}"
        elif inter % world_size:
            problem = f"intermediate_size {inter}"
        else:
            problem = (f"num_key_value_heads {kv_heads} (the KV heads must split evenly over the ranks, or each be "
                       f"replicated on a whole number of ranks)")
        raise UnsupportedConfigError(
            f"{problem} cannot be split over tensor_parallel_size {world_size}; "
            f"tensor_parallel_size values that work for this model: {sizes}"
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_rank = heads // world_size
    q_heads = (rank * per_rank, (rank + 1) * per_rank)
    if kv_heads >= world_size:
        kv_per_rank = kv_heads // world_size
        kv_range = (rank * kv_per_rank, (rank + 1) * kv_per_rank)
    else:  # every rank's query heads use one KV head, replicated on world_size / kv_heads ranks
        kv_head = q_heads[0] // (heads // kv_heads)
        kv_range = (kv_head, kv_head + 1)
    return TensorParallelPlan(rank, world_size, heads, kv_heads, head_dim, inter, config.vocab_size, q_heads,
                              kv_range)


def _shard_attention(attn: Any, plan: TensorParallelPlan) -> None:
    d = plan.head_dim
    q0, q1 = (h * d for h in plan.q_heads)
    kv0, kv1 = (h * d for h in plan.kv_heads)
    attn.q_proj = ColumnParallelLinear.from_linear(attn.q_proj, q0, q1)
    attn.k_proj = ColumnParallelLinear.from_linear(attn.k_proj, kv0, kv1)
    attn.v_proj = ColumnParallelLinear.from_linear(attn.v_proj, kv0, kv1)
    attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, q0, q1)
    attn.num_key_value_groups = plan.local_heads // plan.local_kv_heads
    for name, value in (("num_heads", plan.local_heads), ("num_key_value_heads", plan.local_kv_heads)):
        if hasattr(attn, name):  # older transformers versions keep head counts on the module
            setattr(attn, name, value)


def _shard_mlp(mlp: Any, plan: TensorParallelPlan) -> None:
    per_rank = plan.intermediate_size // plan.world_size
    start, stop = plan.rank * per_rank, (plan.rank + 1) * per_rank
    mlp.gate_proj = ColumnParallelLinear.from_linear(mlp.gate_proj, start, stop)
    mlp.up_proj = ColumnParallelLinear.from_linear(mlp.up_proj, start, stop)
    mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, start, stop)
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = per_rank


def _shard_embeddings(model: Any, plan: TensorParallelPlan) -> None:
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    # HF ties the two when the config says so, except on meta parameters (load_sharded's empty model)
    tied = head is not None and (head.weight is embed.weight or bool(getattr(model.config, "tie_word_embeddings",
                                                                             False)))
    new_embed = VocabParallelEmbedding(plan.vocab_size, embed.embedding_dim, plan.rank, plan.world_size,
                                       embed_scale=getattr(embed, "embed_scale", None), device="meta",
                                       dtype=embed.weight.dtype)
    new_embed.weight = nn.Parameter(_vocab_rows(embed.weight, new_embed), requires_grad=embed.weight.requires_grad)
    model.set_input_embeddings(new_embed)
    if head is None:
        return
    if getattr(head, "bias", None) is not None:
        raise UnsupportedConfigError(f"the LM head of {type(model).__name__} has a bias, which the parallel LM head "
                                     f"does not implement; use tensor_parallel_size 1")
    new_head = ParallelLMHead(embed.embedding_dim, plan.vocab_size, plan.rank, plan.world_size,
                              weight=new_embed.weight if tied else None, device="meta", dtype=head.weight.dtype)
    if not tied:
        new_head.weight = nn.Parameter(_vocab_rows(head.weight, new_head), requires_grad=head.weight.requires_grad)
    model.set_output_embeddings(new_head)


def _vocab_rows(full: torch.Tensor, module: Any) -> torch.Tensor:
    return read_shard(full.detach(), module.shard_specs["weight"])


def shard_model(model: Any, rank: int, world_size: int) -> Any:
    """Make ``model`` (an HF ``*ForCausalLM`` of a supported family, with real or meta parameters) rank ``rank``'s
    part of a ``world_size``-way tensor-parallel model, in place; returns it. Parameters are copied slices, so the
    full tensors are freed; meta parameters stay meta (``load_sharded`` fills them from a checkpoint)."""
    config = model.config
    check_supported(config)
    if hasattr(model, "compile_attn_tp_plan"):
        raise InvalidConfigError(f"the model is already sharded ({model.compile_attn_tp_plan}); shard a fresh model")
    plan = plan_for(config, rank, world_size)
    if world_size == 1:
        model.compile_attn_tp_plan = plan
        return model
    layers = model.get_decoder().layers
    for i, layer in enumerate(layers):
        for part in ("self_attn", "mlp"):
            if not hasattr(layer, part):
                raise UnsupportedConfigError(f"decoder layer {i} of {type(model).__name__} has no {part!r}; "
                                             f"shard_model knows HF decoder layers with self_attn and mlp")
        _shard_attention(layer.self_attn, plan)
        _shard_mlp(layer.mlp, plan)
    _shard_embeddings(model, plan)
    config.head_dim = plan.head_dim  # explicit: it must not be re-derived from the per-rank head count
    config.num_attention_heads = plan.local_heads
    config.num_key_value_heads = plan.local_kv_heads
    config.intermediate_size = plan.intermediate_size // world_size
    model.compile_attn_tp_plan = plan
    logger.info("sharded %s for rank %d of %d: query heads %s, KV heads %s, vocab padded to %d",
                type(model).__name__, rank, world_size, plan.q_heads, plan.kv_heads, plan.padded_vocab_size)
    return model
