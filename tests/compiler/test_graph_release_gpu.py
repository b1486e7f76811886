"""``release_graphs(owner)`` destroys the CUDA graphs created under ``graph_owner(owner)`` and no others (a
tensor-parallel engine releases its graphs before NCCL's abort, which waits for every graph that captured one of
its collectives); a released graph no longer replays, the others still do."""

from __future__ import annotations

import pytest
import torch

from compile_attn.compiler.cuda_graph import capture_graph, graph_owner, release_graphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _add_one_graph(x: torch.Tensor):  # noqa: ANN202
    def add_one() -> None:
        x.add_(1)

    graph, _ = capture_graph(add_one, warm_up=False, run=False)
    return graph


def test_release_destroys_only_the_owners_graphs() -> None:
    mine_x, other_x = torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda")
    with graph_owner("engine A"):
        mine = _add_one_graph(mine_x)
    other = _add_one_graph(other_x)
    mine.replay()
    other.replay()
    torch.cuda.synchronize()
    assert mine_x.tolist() == [1.0] * 4 and other_x.tolist() == [1.0] * 4
    assert mine.owner == "engine A" and other.owner is None

    assert release_graphs("engine A") == 1
    with pytest.raises(RuntimeError):
        mine.replay()  # destroyed
    other.replay()
    torch.cuda.synchronize()
    assert other_x.tolist() == [2.0] * 4 and mine_x.tolist() == [1.0] * 4
    assert release_graphs("engine A") == 0  # released once
