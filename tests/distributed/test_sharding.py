"""Sharding in one process (no process group needed): head assignment, refusals, and that the ranks' parts put
together are the full model's tensors; the partial results of the sharded layers add up to the full layer's."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.hf.hf_tiny_models import FAMILIES, build_pair, tiny_config
from torch import nn

from compile_attn.distributed import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    plan_for,
    shard_model,
)
from compile_attn.errors import InvalidConfigError, UnsupportedConfigError
from compile_attn.hf import attention_layers


@pytest.mark.parametrize(("heads", "kv_heads", "world_size"), [(4, 2, 2), (4, 1, 2), (8, 2, 4), (8, 2, 8), (6, 6, 3),
                                                              (16, 4, 2), (4, 4, 4)])
def test_each_rank_holds_the_kv_heads_its_query_heads_use(heads: int, kv_heads: int, world_size: int) -> None:
    config = tiny_config("llama", num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=heads * 16,
                         head_dim=16)
    group = heads // kv_heads
    seen_q: list[int] = []
    for rank in range(world_size):
        plan = plan_for(config, rank, world_size)
        q = list(range(*plan.q_heads))
        seen_q += q
        assert sorted({h // group for h in q}) == list(range(*plan.kv_heads))
        assert plan.local_heads % plan.local_kv_heads == 0
    assert seen_q == list(range(heads))


@pytest.mark.parametrize(("overrides", "world_size", "message"), [
    ({}, 3, r"num_attention_heads 4 cannot be split over tensor_parallel_size 3; .* work for this model: \[1, 2, 4\]"),
    ({"intermediate_size": 90}, 4, r"intermediate_size 90 cannot be split over tensor_parallel_size 4; .*\[1, 2\]"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16}, 2,
     r"num_key_value_heads 3 .* tensor_parallel_size 2; .*\[1, 3, 6\]"),
])
def test_refuses_what_does_not_split(overrides: dict, world_size: int, message: str) -> None:
    ours, _ = build_pair("llama", **overrides)
    with pytest.raises(UnsupportedConfigError, match=message):
        shard_model(ours, 0, world_size)


def test_refuses_to_shard_twice() -> None:
    ours, _ = build_pair("llama")
    shard_model(ours, 0, 2)
    with pytest.raises(InvalidConfigError, match="already sharded"):
        shard_model(ours, 1, 2)


def _parts(full: nn.Module, world_size: int) -> list[nn.Module]:
    return [shard_model(copy.deepcopy(full), rank, world_size) for rank in range(world_size)]


@pytest.mark.parametrize("family", FAMILIES)
def test_ranks_put_together_are_the_full_model(family: str) -> None:
    full, _ = build_pair(family, vocab_size=97, tie_word_embeddings=family == "gemma2")
    parts = _parts(full, 2)
    cfg = full.config
    for rank, part in enumerate(parts):
        layers = attention_layers(part)  # also checks the constants against every HF attention module
        assert (layers[0].num_heads, layers[0].num_kv_heads) == (cfg.num_attention_heads // 2, 1)
        assert layers[0].head_dim == attention_layers(full)[0].head_dim
        assert (part.lm_head.weight is part.model.embed_tokens.weight) == cfg.tie_word_embeddings
    for name, param in full.named_parameters():
        shards = [dict(p.named_parameters())[name] for p in parts]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            joined = torch.cat(shards, dim=1)
        elif shards[0].shape == param.shape:
            joined = shards[0]
            assert all(torch.equal(s, joined) for s in shards)  # replicated (norms, row-parallel bias)
        else:
            joined = torch.cat(shards, dim=0)[: param.shape[0]]
            if name.endswith("embed_tokens.weight"):
                assert torch.cat(shards).shape[0] == 98 and not shards[-1][-1].any()  # one zero padding row
        torch.testing.assert_close(joined, param, rtol=0, atol=0, msg=name)


def test_partial_results_add_up_to_the_full_layers() -> None:
    """At tensor-parallel size 1 the collectives are the identity, so a rank's module returns its partial result:
    the row-parallel partial sums add up to the full linear, the embedding lookups too, and the LM head's slices
    concatenate to the full logits."""
    torch.manual_seed(0)
    x = torch.randn(5, 12)
    linear = nn.Linear(12, 6)
    row = [RowParallelLinear.from_linear(linear, r * 4, r * 4 + 4) for r in range(3)]
    total = sum(m(x[:, r * 4: r * 4 + 4]) - m.bias for r, m in enumerate(row)) + linear.bias
    torch.testing.assert_close(total, linear(x))
    col = [ColumnParallelLinear.from_linear(linear, r * 2, r * 2 + 2) for r in range(3)]
    torch.testing.assert_close(torch.cat([m(x) for m in col], dim=-1), linear(x))

    table = nn.Embedding(10, 4)
    ids = torch.tensor([0, 3, 9, 4, 5])
    parts, logits = [], []
    for rank in range(4):  # 10 rows padded to 12: 3 per rank
        emb = VocabParallelEmbedding(10, 4, rank, 4, embed_scale=2.0)
        emb.weight = nn.Parameter(torch.cat([table.weight, torch.zeros(2, 4)])[rank * 3: rank * 3 + 3])
        parts.append(emb(ids))
        logits.append(ParallelLMHead(4, 10, rank, 4, weight=emb.weight)(x[:, :4]))
    torch.testing.assert_close(sum(parts), table(ids) * 2.0)
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :10], x[:, :4] @ table.weight.T)
