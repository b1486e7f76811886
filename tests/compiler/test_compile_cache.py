"""Persistent compile cache: a second process loads every piece; keys follow code, config and versions."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.compiler.compile_helpers import SMALL, run_step, toy_model
from torch import fx

from compile_attn.compiler import clear_cache, compile_counters
from compile_attn.compiler.cache import CACHE_SUBDIR, CompileCache, environment_fingerprint
from compile_attn.compiler.piece_key import piece_key
from compile_attn.models.toy_decoder import ToyDecoderConfig
from compile_attn.passes import split_graph

TESTS = Path(__file__).resolve().parent

SECOND_START = """
import json, sys, torch
from tests.compiler.compile_helpers import SMALL, run_step, toy_model
from compile_attn.compiler import compile_counters
model = toy_model(seed=1)  # other weights: weights are inputs of the pieces, not part of the key
compiled = torch.compile(model, backend="compile_attn", dynamic=True, options={"cache_dir": sys.argv[1]})
before = compile_counters.snapshot()
out = run_step(compiled, SMALL, 11, seed=3)
err = (out - run_step(model, SMALL, 11, seed=3)).abs().max().item()
inductor = dict(torch._dynamo.utils.counters["inductor"])
print(json.dumps({"delta": compile_counters.delta(before), "max_err": err, "inductor": inductor}))
"""


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_second_process_loads_every_piece_from_the_cache(tmp_path):
    model = toy_model()
    options = {"cache_dir": str(tmp_path)}
    compiled = torch.compile(model, backend="compile_attn", dynamic=True, options=options)
    with compile_counters.expect(graphs_seen=1, floats_specialized=2, pieces_split=7, split_op_pieces=3,
                                 pieces_compiled=3, pieces_reused=1, cache_misses=3, cache_saves=3):
        run_step(compiled, SMALL, 11, seed=3)
    assert len(list((tmp_path / CACHE_SUBDIR).glob("*.bin"))) == 3

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parents[1])])}
    proc = subprocess.run([sys.executable, "-c", SECOND_START, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["delta"]["cache_hits"] == 3
    assert report["delta"].get("pieces_compiled", 0) == 0 and report["delta"].get("cache_misses", 0) == 0
    # PyTorch's own FX graph cache served the loaded artifacts; nothing was lowered again
    assert report["inductor"].get("fxgraph_cache_hit", 0) >= 3
    assert "fxgraph_cache_miss" not in report["inductor"]
    assert report["max_err"] < 1e-5


def _pieces(cfg: ToyDecoderConfig):
    graphs = []

    def catch(gm, example_inputs):
        graphs.append(split_graph(gm))
        return graphs[-1].split_gm

    torch._dynamo.reset()
    model = toy_model(cfg)
    with torch._dynamo.config.patch(specialize_float=True):
        run_step(torch.compile(model, backend=catch, dynamic=True), cfg, 5, seed=0)
    return [(p, [n.meta["example_value"] for n in p.graph_module.graph.find_nodes(op="placeholder")])
            for p in graphs[0].compiled_pieces]


def test_piece_keys_follow_the_traced_code():
    first = [piece_key(p.graph_module, ex) for p, ex in _pieces(SMALL)]
    again = [piece_key(p.graph_module, ex) for p, ex in _pieces(SMALL)]
    wider = [piece_key(p.graph_module, ex) for p, ex in _pieces(SMALL.__class__(**{**SMALL.__dict__,
                                                                                   "intermediate_size": 96}))]
    assert all(k.stable for k in first)
    assert [k.digest for k in first] == [k.digest for k in again]
    assert len({k.digest for k in first}) == 3  # first, middle (x2), last
    assert first[1].digest == first[2].digest
    assert wider[0].digest == first[0].digest  # embedding + first attention input: no MLP inside
    assert wider[1].digest != first[1].digest and wider[3].digest != first[3].digest


def test_entry_key_covers_options_and_grad_mode(tmp_path):
    (piece, example), *_ = _pieces(SMALL)
    key = piece_key(piece.graph_module, example)
    cache = CompileCache(tmp_path)
    base = cache.entry_key(key, environment_fingerprint([], {}))
    assert base == cache.entry_key(key, environment_fingerprint([], {}))
    assert base != cache.entry_key(key, environment_fingerprint([], {"max_autotune": True}))
    with torch.no_grad():
        assert base != cache.entry_key(key, environment_fingerprint([], {}))


def test_unreadable_entry_is_dropped_and_clear_cache_empties(tmp_path):
    cache = CompileCache(tmp_path)
    cache.dir.mkdir(parents=True)
    cache.path("deadbeef").write_bytes(b"not an artifact")
    assert cache.load("deadbeef") is None
    assert not cache.path("deadbeef").exists()
    cache.path("cafe").write_bytes(b"x")
    assert clear_cache(tmp_path) == 1
    assert not cache.dir.exists()


def _clear_in_memory_caches() -> None:
    """What a new process would not have: Dynamo's compiled frames and Inductor's in-memory code caches (the
    on-disk caches stay, as between two starts)."""
    from torch._inductor.codecache import PyCodeCache

    torch._dynamo.reset()
    PyCodeCache.cache_clear(purge=False)


def test_static_one_token_pieces_are_saved_and_served_from_the_cache(tmp_path, caplog):
    """``compile_sizes=(1,)`` (the GPU default) rewrites one-row linears as reductions; that rewrite must leave
    graphs PyTorch can serialise, so every artifact is saved and a warm start compiles nothing, silently."""
    from compile_attn.compiler.compiled_model import compile_model

    options = {"cache_dir": str(tmp_path), "compile_sizes": (1,)}
    with caplog.at_level(logging.WARNING, logger="compile_attn"):
        compiled = compile_model(toy_model(), options)
        with compile_counters.expect(graphs_seen=1, pieces_split=7, split_op_pieces=3, pieces_compiled=3,
                                     pieces_reused=1, pieces_compiled_static=3, cache_misses=6, cache_saves=6):
            run_step(compiled, SMALL, 1, seed=3)
        assert len(list((tmp_path / CACHE_SUBDIR).glob("*.bin"))) == 6

        _clear_in_memory_caches()
        model = toy_model(seed=1)
        again = compile_model(model, options)
        with compile_counters.expect(graphs_seen=1, pieces_split=7, split_op_pieces=3, pieces_reused=1,
                                     cache_hits=6):  # no compile of any piece, static ones included
            for tokens in (1, 6):
                out = run_step(again, SMALL, tokens, seed=tokens)
                torch.testing.assert_close(out, run_step(model, SMALL, tokens, seed=tokens), rtol=1e-5, atol=1e-5)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]


def test_unserialisable_artifact_is_not_saved_and_logged_once_at_debug(tmp_path, caplog):
    """A piece PyTorch cannot serialise (its graph calls a plain Python function) falls back to Inductor's own
    caches: not saved, counted, one debug line for the process, no warning."""
    import compile_attn.compiler.cache as cache_module

    def plain_python(x):  # noqa: ANN001, ANN202 - not a torch function: AOTAutograd's cache skips such graphs
        return x * 2

    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = torch.empty(3)
    graph.output((graph.call_function(plain_python, (x,)),))
    from torch._inductor import standalone_compile

    artifact = standalone_compile(fx.GraphModule({}, graph), [torch.ones(3)], dynamic_shapes="from_example_inputs",
                                  options={})
    cache = CompileCache(tmp_path)
    cache_module._unsaveable_logged = False
    with caplog.at_level(logging.DEBUG, logger="compile_attn"):
        assert not cache.save("a", artifact) and not cache.save("b", artifact)
    assert not cache.path("a").exists() and not cache.path("b").exists()
    messages = [r for r in caplog.records if r.name.startswith("compile_attn")]
    assert len(messages) == 1 and messages[0].levelno == logging.DEBUG, [r.getMessage() for r in messages]
    torch.testing.assert_close(artifact(torch.ones(3))[0], torch.full((3,), 2.0))
