"""torch.compile(model, backend="compile_attn") on CPU: outputs vs eager, counters, recompiles, dump."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from tests.compiler.compile_helpers import SMALL, GatedMLP, run_step, toy_model

from compile_attn.compiler import compile_counters, resolve_config
from compile_attn.env import host_shortcuts_enabled
from compile_attn.config import GraphConfig

ROOT = Path(__file__).resolve().parents[2]
# the toy model's three attention pieces call the op's body directly, unless COMPILE_ATTN_HOST_SHORTCUTS=0
DIRECT_SPLIT_CALLS = 3 if host_shortcuts_enabled() else 0


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_inductor_pieces_match_eager_and_identical_layers_compile_once():
    model = toy_model()
    compiled = torch.compile(model, backend="compile_attn", dynamic=True, options={"cache_dir": None})
    # 3 layers: [first, attn, middle, attn, middle, attn, last]; the two middle pieces are identical
    with compile_counters.expect(graphs_seen=1, floats_specialized=2, pieces_split=7, split_op_pieces=3,
                                 pieces_compiled=3, pieces_reused=1, split_calls_direct=DIRECT_SPLIT_CALLS):
        out = run_step(compiled, SMALL, 11, seed=3)
    torch.testing.assert_close(out, run_step(model, SMALL, 11, seed=3), rtol=1e-5, atol=1e-5)
    with compile_counters.expect():  # other token counts (>= 2: Dynamo specializes 1) reuse the code
        for num_tokens, seed in ((2, 5), (29, 6), (64, 7)):
            out = run_step(compiled, SMALL, num_tokens, seed=seed)
            expected = run_step(model, SMALL, num_tokens, seed=seed)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_inductor_model_without_attention_is_one_compiled_piece():
    torch.manual_seed(0)
    model = GatedMLP().eval()
    compiled = torch.compile(model, backend="compile_attn", dynamic=True, options={"cache_dir": None})
    x = torch.randn(13, 32)
    expected_counts = {"graphs_seen": 1, "floats_specialized": 1, "pieces_split": 1, "pieces_compiled": 1}
    with compile_counters.expect(**expected_counts), torch.no_grad():  # LayerNorm's eps is a Python float
        out = compiled(x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


def test_no_recompiles_across_token_counts_after_warmup():
    model = toy_model()
    compiled = torch.compile(model, backend="compile_attn", options={"compiler": "eager", "cache_dir": None})
    for num_tokens in (3, 4, 1):  # default dynamic=None: static, then dynamic, then the 0/1-specialized size
        run_step(compiled, SMALL, num_tokens, seed=num_tokens)
    with compile_counters.expect():
        for num_tokens in range(5, 35):
            out = run_step(compiled, SMALL, num_tokens, seed=num_tokens)
            if num_tokens % 10 == 0:
                torch.testing.assert_close(out, run_step(model, SMALL, num_tokens, seed=num_tokens),
                                           rtol=1e-6, atol=1e-6)


def test_compile_model_compiles_once_for_every_token_count_and_every_input_offset():
    """compile_model (the engine's): one graph for 1 token and for many, with ids and positions that are views at
    a storage offset into one upload (ForwardBatch.build), as eager engine steps pass them; every compiled piece
    reads its token count (capturable)."""
    from compile_attn.compiler.compiled_model import compile_model

    model = toy_model()
    compiled = compile_model(model, {"compiler": "eager", "cache_dir": None})
    with compile_counters.expect(graphs_seen=1, pieces_split=7, split_op_pieces=3, split_calls_direct=DIRECT_SPLIT_CALLS):
        for num_tokens in (5, 1, 6, 1, 17):
            out = run_step(compiled, SMALL, num_tokens, seed=num_tokens)
            torch.testing.assert_close(out, run_step(model, SMALL, num_tokens, seed=num_tokens), rtol=1e-6, atol=1e-6)


def test_dynamic_true_compiles_one_graph_for_all_token_counts():
    model = toy_model()
    compiled = torch.compile(model, backend="compile_attn", dynamic=True, options={"compiler": "eager"})
    with compile_counters.expect(graphs_seen=1, floats_specialized=2, pieces_split=7, split_op_pieces=3):
        for num_tokens in (2, 7, 19):
            out = run_step(compiled, SMALL, num_tokens, seed=num_tokens)
            torch.testing.assert_close(out, run_step(model, SMALL, num_tokens, seed=num_tokens), rtol=1e-6, atol=1e-6)


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 0.5  # a Python float Dynamo would pass as a tensor input
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * self.scale


def test_python_floats_are_specialized_and_guarded():
    model = _Scaled()
    compiled = torch.compile(model, backend="compile_attn", dynamic=True, options={"compiler": "eager"})
    x = torch.randn(5, 8)
    with torch.no_grad():
        with compile_counters.expect(graphs_seen=1, floats_specialized=1, pieces_split=1):
            torch.testing.assert_close(compiled(x), model(x))
        model.scale = 2.0  # the specialized value is guarded: a change recompiles instead of going stale
        with compile_counters.expect(graphs_seen=1, recompiles=1, pieces_split=1):
            torch.testing.assert_close(compiled(x), model(x))


def test_debug_dump_has_decompiled_code_piece_graphs_and_summary(tmp_path, monkeypatch):
    pytest.importorskip("depyf")
    monkeypatch.setenv("COMPILE_ATTN_DEBUG_DIR", str(tmp_path))
    model = toy_model()
    compiled = torch.compile(model, backend="compile_attn", dynamic=True, options={"compiler": "eager"})
    run_step(compiled, SMALL, 6, seed=0)
    (graph_dir,) = tmp_path.iterdir()
    names = {p.name for p in graph_dir.iterdir()}
    assert {"dynamo_graph.py", "split_graph.py", "summary.txt", "decompiled_forward.py",
            "original_forward.py"} <= names
    pieces = sorted(n for n in names if n.startswith("piece_"))
    assert pieces == [f"piece_{i:02d}_submod_{i}.py" for i in range(7)]
    assert "__compiled_fn" in (graph_dir / "decompiled_forward.py").read_text()
    assert "compile_attn.attention" in (graph_dir / "piece_01_submod_1.py").read_text()
    summary = (graph_dir / "summary.txt").read_text()
    assert "pieces: 7 (4 compiled, 3 split-op)" in summary
    assert summary.count("compile_attn::attention") == 3


def test_inductor_config_patches_reach_the_piece_compiler(monkeypatch):
    seen = []
    from compile_attn.compiler import piece_compiler
    from compile_attn.compiler.fusion_choices import UnbackedFusionChoices

    real = piece_compiler.PieceCompiler._inductor_compile

    def spy(self, name, gm, example_inputs, dynamic_shapes, patches):
        seen.append(dict(patches))  # what Inductor is given
        return real(self, name, gm, example_inputs, dynamic_shapes, patches)

    monkeypatch.setattr(piece_compiler.PieceCompiler, "_inductor_compile", spy)
    torch.manual_seed(0)
    model = GatedMLP().eval()
    options = {"cache_dir": None, "inductor_config": {"combo_kernels": True}}
    compiled = torch.compile(model, backend="compile_attn", dynamic=True, options=options)
    x = torch.randn(13, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert seen and all(p.get("combo_kernels") is True for p in seen)
    assert all(p.get("inductor_choices_class") is UnbackedFusionChoices for p in seen)  # compile_attn's default
    with pytest.raises(TypeError, match="inductor_config"):
        GraphConfig(inductor_config=[("combo_kernels", True)])
    with pytest.raises(ValueError, match=r"unknown Inductor option\(s\) \['combo_kernel'\]"):
        GraphConfig(inductor_config={"combo_kernel": True})  # a misspelling is refused before any compile
    GraphConfig(inductor_config={"triton.max_tiles": 2})  # nested options are dotted


def test_options_and_config_object():
    assert resolve_config({"compiler": "eager"}).compiler == "eager"
    config = GraphConfig(compiler="eager", extend_token_sizes=(8, 16))
    assert resolve_config({"config": config, "cache_dir": None}) == config.replace(cache_dir=None)
    with pytest.raises(ValueError, match="known options"):
        resolve_config({"capture_sizes": (8,)})
    with pytest.raises(ValueError, match="'prefill_token_sizes' is now 'extend_token_sizes'"):
        resolve_config({"prefill_token_sizes": (8,)})
    with pytest.raises(ValueError, match="compiler"):
        resolve_config({"compiler": "tvm"})
    with pytest.raises(TypeError, match="GraphConfig"):
        resolve_config({"config": {"compiler": "eager"}})


def test_debug_dir_env_is_the_default_and_an_explicit_none_writes_no_dump(tmp_path, monkeypatch):
    """$COMPILE_ATTN_DEBUG_DIR is read once, as GraphConfig.debug_dir's default: a config made with
    ``debug_dir=None`` dumps nothing even while it is set."""
    monkeypatch.setenv("COMPILE_ATTN_DEBUG_DIR", str(tmp_path / "env"))
    assert GraphConfig().debug_dir == str(tmp_path / "env")
    model = toy_model()
    compiled = torch.compile(model, backend="compile_attn", dynamic=True,
                             options={"compiler": "eager", "debug_dir": None, "cache_dir": None})
    torch.testing.assert_close(run_step(compiled, SMALL, 6, seed=0), run_step(model, SMALL, 6, seed=0))
    assert not (tmp_path / "env").exists()


def test_entry_point_names_the_backend():
    pyproject = (ROOT / "pyproject.toml").read_text()
    section = pyproject.split("[project.entry-points.torch_dynamo_backends]", 1)[1]
    module, attr = re.search(r'compile_attn\s*=\s*"([\w.]+):(\w+)"', section).groups()
    assert callable(getattr(importlib.import_module(module), attr))
    assert "compile_attn" in torch._dynamo.list_backends(exclude_tags=())


@pytest.mark.skipif("compile_attn" not in entry_points(group="torch_dynamo_backends").names,
                    reason="compile_attn is not installed (pip install -e .)")
def test_backend_name_works_without_importing_compile_attn():
    code = (
        "import sys, torch\n"
        "f = torch.compile(lambda x: torch.relu(x) * 2, backend='compile_attn',\n"
        "                  options={'compiler': 'eager'})\n"
        "assert torch.equal(f(torch.randn(4) * 0 + 1), torch.full((4,), 2.0))\n"
        "print('loaded', 'compile_attn' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd="/",
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "loaded True" in out.stdout
