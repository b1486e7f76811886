"""Mode planning: the mode table, and one log line saying why for every downgrade."""

from __future__ import annotations

import logging

import pytest
import torch
from tests.graph_runner.gr_helpers import SMALL, CountingBackend, Twin, make_model, run_scenario

from compile_attn.config import GraphConfig
from compile_attn.graph_runner import GraphMode, GraphRunner, plan_modes
from compile_attn.graph_runner.plan import is_compiled

F, P, B, N = GraphMode.FULL, GraphMode.PIECEWISE, GraphMode.BREAKABLE, GraphMode.NONE
FULL_DECODE = GraphMode.FULL_AND_PIECEWISE  # what a backend declares when decode can be one full graph


@pytest.mark.parametrize(
    ("mode", "support", "compiled", "decode", "extend"),
    [
        (GraphMode.NONE, FULL_DECODE, True, N, N),
        (GraphMode.FULL, FULL_DECODE, False, F, N),
        (GraphMode.FULL_AND_PIECEWISE, FULL_DECODE, True, F, P),
        (GraphMode.FULL_AND_PIECEWISE, FULL_DECODE, False, F, B),
        (GraphMode.PIECEWISE, FULL_DECODE, True, P, P),
        (GraphMode.BREAKABLE, FULL_DECODE, False, B, B),
    ],
)
def test_plan_without_downgrade_logs_nothing_unexpected(
    mode, support, compiled, decode, extend, caplog
) -> None:
    with caplog.at_level(logging.INFO, logger="compile_attn.graph_runner.plan"):
        plan = plan_modes(mode, support, compiled=compiled, backend_name="x")
    assert (plan.decode, plan.extend) == (decode, extend)
    expected_lines = int(not compiled and B in (decode, extend) and mode is not GraphMode.BREAKABLE)
    assert len(caplog.records) == expected_lines


@pytest.mark.parametrize(
    ("mode", "support", "compiled", "decode", "extend", "why"),
    [
        (GraphMode.FULL_AND_PIECEWISE, GraphMode.NONE, True, N, N, "graph_support none"),
        (
            GraphMode.FULL_AND_PIECEWISE,
            GraphMode.PIECEWISE,
            True,
            P,
            P,
            "graph_support piecewise",
        ),
        (GraphMode.FULL, GraphMode.PIECEWISE, True, P, N, "graph_support piecewise"),
        (GraphMode.BREAKABLE, FULL_DECODE, True, P, P, "torch.compile'd"),
    ],
)
def test_downgrades_log_one_line_saying_why(mode, support, compiled, decode, extend, why, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="compile_attn.graph_runner.plan"):
        plan = plan_modes(mode, support, compiled=compiled, backend_name="x")
    assert (plan.decode, plan.extend) == (decode, extend)
    assert len(caplog.records) == 1 and why in caplog.records[0].getMessage()


class PiecewiseOnlyBackend(CountingBackend):
    graph_support = GraphMode.PIECEWISE


def test_piecewise_only_backend_runs_decode_breakable_with_correct_results() -> None:
    model = make_model()
    twin = Twin(seed=11)
    layers = model.attention_layers()
    config = GraphConfig(
        mode="full", decode_batch_sizes=(1, 2, 4, 8), extend_token_sizes=(16,), cache_dir=None
    )
    runner = GraphRunner(
        model, PiecewiseOnlyBackend(twin.caches[0], layers), config, max_batch_size=8, max_num_tokens=64
    )
    assert (runner.plan.decode, runner.plan.extend) == (B, N)
    runner.capture()
    assert runner.stats.captures == {"breakable": 4}
    run_scenario(
        runner,
        model,
        CountingBackend(twin.caches[1], layers),
        twin,
        [("decode", 3), ("decode", 8), ("extend", 12), ("decode", 1)],
    )
    assert runner.stats.runs["breakable"] >= 3 and runner.stats.runs["none"] >= 1


def test_is_compiled() -> None:
    model = make_model()
    assert not is_compiled(model)
    assert is_compiled(torch.compile(model, backend="eager"))
    assert is_compiled(torch.compile(lambda x: x, backend="eager"))
    assert SMALL.num_layers == len(torch.compile(model, backend="eager").attention_layers())


def test_buckets_are_clipped_to_the_static_buffers() -> None:
    model = make_model()
    twin = Twin()
    config = GraphConfig(
        mode="full_and_piecewise", cache_dir=None
    )  # default buckets: decode up to 256, tokens up to 2048
    runner = GraphRunner(
        model,
        CountingBackend(twin.caches[0], model.attention_layers()),
        config,
        max_batch_size=20,
        max_num_tokens=100,
    )
    assert runner.decode_buckets == (1, 2, 4, 8, 16)
    assert runner.extend_buckets == (16, 32, 64)


def test_one_mode_splits_into_what_runs_for_decode_and_for_mixed_batches() -> None:
    """GraphMode's table (docs/graph_runner.md): each requested mode's decode and mixed routine."""
    table = {"none": ("none", "none"), "piecewise": ("piecewise", "piecewise"), "full": ("full", "none"),
             "full_and_piecewise": ("full", "piecewise"), "breakable": ("breakable", "breakable")}
    assert {m.value: (m.decode_mode().value, m.extend_mode().value) for m in GraphMode} == table
    assert GraphMode.parse("FULL_AND_PIECEWISE") is GraphMode.FULL_AND_PIECEWISE
    with pytest.raises(ValueError, match="choose one of none, piecewise, full, full_and_piecewise, breakable"):
        GraphMode.parse("fast")


def test_backends_declare_graph_support_on_the_class_only() -> None:
    """No attention backend assigns ``graph_support`` on an instance (``supported_graph_mode`` narrows it)."""
    import ast
    from pathlib import Path

    import compile_attn.attention as attention_package

    root = Path(attention_package.__file__).parent
    assigned = [f"{path.name}:{node.lineno}" for path in root.rglob("*.py")
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(target, ast.Attribute) and target.attr == "graph_support"]
    assert not assigned, assigned
