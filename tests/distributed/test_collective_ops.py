"""The tensor-parallel state and collective ops in one process: size 1 needs no torch.distributed, the ops pass
``torch.library.opcheck``, trace under ``fullgraph=True`` across token counts, and are not split ops."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import compile_attn  # noqa: F401  (registers the attention op)
from compile_attn.distributed import (
    all_gather_last_dim,
    all_reduce,
    destroy_tensor_parallel,
    init_tensor_parallel,
    tp_group,
    tp_group_name,
    tp_rank,
    tp_size,
)
from compile_attn.errors import InvalidConfigError
from compile_attn.ops import is_split_op


def test_size_one_needs_no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert (tp_rank(), tp_size(), tp_group(), tp_group_name()) == (0, 1, None, "")
    state = init_tensor_parallel()
    assert (state.rank, state.world_size, state.group) == (0, 1, None)
    assert not torch.distributed.is_initialized()
    destroy_tensor_parallel()
    assert tp_size() == 1


@pytest.mark.parametrize(("rank", "world_size"), [(2, 2), (-1, 2), (0, 0)])
def test_bad_rank_names_the_values(rank: int, world_size: int) -> None:
    with pytest.raises(InvalidConfigError, match=f"rank {rank} of world_size {world_size}"):
        init_tensor_parallel(rank, world_size)


def test_rank_and_size_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InvalidConfigError, match="rank 3 of world_size 2"):
        init_tensor_parallel()


def test_size_one_collectives_are_the_input() -> None:
    x = torch.randn(3, 5)
    assert all_reduce(x) is x
    assert all_gather_last_dim(x) is x


def test_collectives_are_not_split_ops() -> None:
    assert is_split_op(torch.ops.compile_attn.attention.default)
    assert not is_split_op(torch.ops.compile_attn.tp_all_reduce.default)
    assert not is_split_op(torch.ops.compile_attn.tp_all_gather.default)


def test_opcheck() -> None:
    x = torch.randn(4, 6)
    torch.library.opcheck(torch.ops.compile_attn.tp_all_reduce.default, (x, ""))
    torch.library.opcheck(torch.ops.compile_attn.tp_all_gather.default, (x, "", 1))
    torch.testing.assert_close(torch.ops.compile_attn.tp_all_reduce(x, ""), x, rtol=0, atol=0)


def test_ops_trace_in_one_graph_across_token_counts() -> None:
    torch._dynamo.reset()
    counter = CompileCounter()

    def body(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.compile_attn.tp_all_reduce(x * 2, "")
        return torch.ops.compile_attn.tp_all_gather(y + 1, "", 1)

    compiled = torch.compile(body, backend=counter, fullgraph=True, dynamic=True)
    for tokens in (3, 7, 12):
        x = torch.randn(tokens, 8)
        torch.testing.assert_close(compiled(x), x * 2 + 1, rtol=0, atol=0)
    assert counter.frame_count == 1
