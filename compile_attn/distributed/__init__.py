"""Tensor parallelism on torch.distributed: the group state, the collective ops, sharded layers, HF sharding.

``init_tensor_parallel`` / ``destroy_tensor_parallel`` and the ``tp_*`` accessors (``state``); the custom ops
``compile_attn::tp_all_reduce`` and ``compile_attn::tp_all_gather``, which the compile backend keeps inside its
pieces (``all_reduce``, ``all_gather``); column / row-parallel linears and the vocab-parallel embedding and LM head
(``linear``, ``embedding``); ``shard_model`` and ``load_sharded`` for HF models (``shard_hf``, ``load_hf``,
imported on first use, as they need transformers). See docs/tensor_parallel.md.
"""

from __future__ import annotations

from typing import Any

from compile_attn.distributed.all_gather import all_gather_last_dim, tp_all_gather
from compile_attn.distributed.all_reduce import all_reduce, tp_all_reduce
from compile_attn.distributed.embedding import ParallelLMHead, VocabParallelEmbedding
from compile_attn.distributed.linear import ColumnParallelLinear, RowParallelLinear
from compile_attn.distributed.partition import ShardSpec
from compile_attn.distributed.state import (
    TensorParallelState,
    destroy_tensor_parallel,
    init_tensor_parallel,
    tp_group,
    tp_group_name,
    tp_rank,
    tp_size,
    tp_state,
)

_LAZY = {
    "shard_model": "compile_attn.distributed.shard_hf",
    "plan_for": "compile_attn.distributed.shard_hf",
    "TensorParallelPlan": "compile_attn.distributed.shard_hf",
    "load_sharded": "compile_attn.distributed.load_hf",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ColumnParallelLinear",
    "ParallelLMHead",
    "RowParallelLinear",
    "ShardSpec",
    "TensorParallelPlan",
    "TensorParallelState",
    "VocabParallelEmbedding",
    "all_gather_last_dim",
    "all_reduce",
    "destroy_tensor_parallel",
    "init_tensor_parallel",
    "load_sharded",
    "plan_for",
    "shard_model",
    "tp_all_gather",
    "tp_all_reduce",
    "tp_group",
    "tp_group_name",
    "tp_rank",
    "tp_size",
    "tp_state",
]
