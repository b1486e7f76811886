"""HF models with attn_implementation="compile_attn" under torch.compile: one graph, right logits.

``backend="eager"`` with ``fullgraph=True`` checks that Dynamo traces the HF model and our attention
function without a graph break and without recompiling across token counts; the ``compile_attn``
backend tests run once ``compile_attn.compiler`` exists (skipped with the reason until then).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from tests.hf.hf_steps import random_sequences, run_scenario
from tests.hf.hf_tiny_models import FAMILIES, build_pair
from tests.reference import max_rel_error
from torch._dynamo.testing import CompileCounter

from compile_attn.hf import HFModelAdapter

TOL = 1e-4


def _run_and_check(family: str, compiled_factory) -> None:  # noqa: ANN001
    torch._dynamo.reset()
    ours, ref = build_pair(family, attn="eager")
    adapter = HFModelAdapter(ours)
    compiled = compiled_factory(adapter)
    kv = adapter.make_kv_cache(max_batch_size=8, max_context=64, kv_cache_tokens=256)
    sequences = random_sequences(adapter.vocab_size, seed=5)
    logits = run_scenario(compiled, kv, "torch_native", adapter.attention_layers(), sequences)
    with torch.no_grad():
        for i, (seq, got) in enumerate(zip(sequences, logits, strict=True)):
            err = max_rel_error(got, ref(seq[None]).logits[0])
            assert err <= TOL, f"{family} request {i}: relative error {err:.2e} > {TOL}"


@pytest.mark.parametrize("family", FAMILIES)
def test_dynamo_traces_whole_model(family: str) -> None:
    counter = CompileCounter()
    _run_and_check(family, lambda m: torch.compile(m, backend=counter, fullgraph=True))
    # three steps of 21, 41 and 4 tokens: one static graph, then one dynamic graph for every later size
    assert counter.frame_count == 2
    assert counter.op_count > 0


def _compile_attn_backend():  # noqa: ANN202
    """The backend by name when registered (installed entry point), else the entry point's function.

    Skips only while the backend module does not exist yet; any other import error fails the test.
    """
    try:
        module = importlib.import_module("compile_attn.compiler.backend")
    except ModuleNotFoundError as exc:
        if exc.name not in ("compile_attn.compiler", "compile_attn.compiler.backend"):
            raise
        pytest.skip(
            f"the compile backend (compile_attn.compiler.backend, another issue) has not landed yet: {exc}"
        )
    try:
        torch._dynamo.lookup_backend("compile_attn")
        return "compile_attn"
    except Exception:  # noqa: BLE001 - not pip-installed: no torch_dynamo_backends entry point
        return module.compile_attn_backend


@pytest.mark.parametrize(("family", "compiler"), [(f, "eager") for f in FAMILIES] + [("gemma2", "inductor")])
def test_compile_attn_backend(family: str, compiler: str) -> None:
    backend = _compile_attn_backend()
    from compile_attn.compiler import compile_counters

    before = compile_counters.snapshot()
    options = {"compiler": compiler, "cache_dir": None}
    _run_and_check(family, lambda m: torch.compile(m, backend=backend, options=options))
    delta = compile_counters.delta(before)
    # the backend really split the graph at both layers' attention ops
    assert delta.get("split_op_pieces", 0) >= 2, delta


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_compiled_outside_context_equals_stock(family: str) -> None:
    """Without a forward context the fallback traces as one graph and matches the stock model."""
    torch._dynamo.reset()
    ours, stock = build_pair(family, attn="stock")
    ids = torch.randint(0, ours.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(6))
    compiled = torch.compile(ours, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(
            compiled(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=0, atol=0
        )
