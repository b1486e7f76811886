"""Piecewise CUDA graphs on a GPU: per-bucket capture and replay vs eager, graph counts, refused replays."""

from __future__ import annotations

import pytest
import torch
from tests.compiler.compile_helpers import SMALL, run_step, toy_model

from compile_attn.compiler import compile_counters
from compile_attn.errors import GraphReplayError

pytestmark = pytest.mark.gpu

BUCKETS = (64, 32, 16)  # captured largest first, as the GraphRunner does
COMPILED_PIECES = SMALL.num_layers + 1
TOL = {"rtol": 2e-4, "atol": 2e-4}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(model, **options):
    options = {"cache_dir": None, **options}  # no sizes: the steps name their buckets (as a GraphRunner's do)
    return torch.compile(model, backend="compile_attn", dynamic=True, options=options)


def _static_buffers(size: int = max(BUCKETS)) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.zeros(size, dtype=torch.int64, device="cuda") for _ in range(2))


def _piecewise_step(compiled, size: int, seed: int, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """A step on the static buffers, as a runner's piecewise step of bucket ``size`` when it is one of BUCKETS
    (else as an eager step, which runs the pieces without graphs)."""
    return run_step(compiled, SMALL, size, seed, device="cuda", input_ids=ids[:size], positions=pos[:size],
                    bucket=size if size in BUCKETS else None)


def test_buckets_capture_once_and_replay_with_correct_results():
    model = toy_model(device="cuda")
    compiled = _compiled(model)
    ids, pos = _static_buffers()
    run_step(compiled, SMALL, 5, seed=0, device="cuda")  # compile at a size outside the buckets: no graphs
    with compile_counters.expect(graphs_captured=len(BUCKETS) * COMPILED_PIECES,
                                 graph_replays=len(BUCKETS) * 2 * COMPILED_PIECES):
        for size in BUCKETS:
            for seed in (1, 2, 3):  # capture, then two replays with new tokens, positions and KV
                out = _piecewise_step(compiled, size, seed, ids, pos)
                torch.testing.assert_close(out, run_step(model, SMALL, size, seed, device="cuda"), **TOL)
    with compile_counters.expect():  # a step that names no bucket runs the compiled pieces without graphs
        out = _piecewise_step(compiled, 24, 4, ids, pos)
    torch.testing.assert_close(out, run_step(model, SMALL, 24, 4, device="cuda"), **TOL)


def test_replay_with_moved_inputs_is_refused_and_still_correct():
    model = toy_model(device="cuda")
    compiled = _compiled(model)
    ids, pos = _static_buffers()
    _piecewise_step(compiled, 32, 1, ids, pos)  # capture
    # other buffers of the same shape (so Dynamo's guards still hold): the inputs moved. Piece 0 is
    # refused, runs without its graph, and so every later piece sees moved inputs too.
    other_ids, other_pos = _static_buffers()
    with compile_counters.expect(replays_refused=COMPILED_PIECES, graph_replays=0):
        out = _piecewise_step(compiled, 32, 2, other_ids, other_pos)
    torch.testing.assert_close(out, run_step(model, SMALL, 32, 2, device="cuda"), **TOL)


def test_replay_with_moved_inputs_is_an_error_in_debug_mode(tmp_path):
    model = toy_model(device="cuda")
    compiled = _compiled(model, compiler="eager", debug_dir=str(tmp_path))
    ids, pos = _static_buffers()
    _piecewise_step(compiled, 16, 1, ids, pos)
    other_ids, other_pos = _static_buffers()
    with pytest.raises(GraphReplayError, match="at 16 tokens"):
        _piecewise_step(compiled, 16, 2, other_ids, other_pos)
    (graph_dir,) = tmp_path.iterdir()
    assert "submod_0: [16]" in (graph_dir / "summary.txt").read_text()


@pytest.mark.parametrize("patch", [{"combo_kernels": True}, {"coordinate_descent_tuning": True}],
                         ids=["combo_kernels", "coordinate_descent_tuning"])
def test_inductor_config_patches_keep_results_and_graphs(patch):
    """Inductor options the benchmarks try for decode (opt-in through ``inductor_config``): same results as eager
    in every bucket and between buckets, one compile for every token count, one capture per bucket and piece."""
    model = toy_model(device="cuda")
    compiled = _compiled(model, inductor_config=patch)
    ids, pos = _static_buffers()
    run_step(compiled, SMALL, 5, seed=0, device="cuda")  # the one compile, at a size outside the buckets
    with compile_counters.expect(graphs_captured=len(BUCKETS) * COMPILED_PIECES,
                                 graph_replays=len(BUCKETS) * COMPILED_PIECES):  # no compile, no recompile
        for size in (*BUCKETS, *BUCKETS, 24):  # capture, replay, then a size between buckets (no graphs)
            out = _piecewise_step(compiled, size, size, ids, pos)
            torch.testing.assert_close(out, run_step(model, SMALL, size, size, device="cuda"), **TOL)
