"""The engine's shared-prefix (cascade) decode inside its graph modes on the CPU (interpreted Triton kernels):
requests behind one system prompt decode through the cascade kernels (their calls counted) with the greedy tokens
of the engine without it and of HF ``generate``, every page accounted for after every step, and no Dynamo compile
after capture. The engine's default mode ``full_and_piecewise`` runs decode piecewise with interpreted kernels, so a
subclass that declares full decode graphs (run on the CPU by re-running the captured step) checks that decode
batches with groups leave the full graph for the piecewise one and that the others stay in it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from compile_attn.attention import registry
from compile_attn.attention.triton import cascade as triton_cascade
from compile_attn.attention.triton.backend import TritonBackend
from compile_attn.compiler import compile_counters
from compile_attn.engine import LLM, SamplingParams
from compile_attn.graph_mode import GraphMode
from compile_attn.kv.page_account import page_account
from tests.hf.hf_tiny_models import hf_greedy

SYSTEM = [(7 * j + 3) % 96 for j in range(37)]
PROMPTS = [SYSTEM + [(5 * i + j) % 96 for j in range(1 + i % 3)] for i in range(5)]
PROMPTS.append([(11 * j + 2) % 96 for j in range(13)])  # shares nothing: in no group
N_NEW = 4
PAGE = 4

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU interpreter tests; the GPU runs test_cascade_graphs_gpu.py"
)


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, list[list[int]]]:
    """A 2-layer Llama with a head dim the kernels take (``compile_attn`` attention) and HF ``generate``'s greedy
    tokens for each prompt from the same weights with HF's eager attention."""
    cfg = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, max_position_embeddings=128, initializer_range=0.2,
               tie_word_embeddings=False)
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), attn_implementation="compile_attn",
                                            dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), attn_implementation="eager", dtype=torch.float32).eval()
    ref.load_state_dict(ours.state_dict())
    refs = [hf_greedy(ref, p, N_NEW) for p in PROMPTS]
    return ours, refs


@pytest.fixture
def cascade_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the cascade kernels' launches (``cascade_decode_fwd``, one per decode layer), which still run."""
    calls = [0]
    real = triton_cascade.cascade_decode_fwd

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_cascade, "cascade_decode_fwd", counted)
    return calls


class FullDecodeTriton(TritonBackend):
    """The triton backend declaring full decode graphs with interpreted kernels: on the CPU the runner 'captures' a
    compiled model's full decode step by re-running it (``graph_runner.full_graph``), so the full route runs."""

    def supported_graph_mode(self) -> GraphMode:
        return self.graph_support


@pytest.fixture
def full_decode_backend() -> Iterator[str]:
    name = "triton_full_decode_test"
    registry.register_backend(name)(FullDecodeTriton)
    yield name
    registry._BACKENDS.pop(name, None)


def run_engine(model: torch.nn.Module, backend: str, compile: bool, cascade: bool,
               calls: list[int]) -> tuple[LLM, list[list[int]]]:
    """The prompts through an engine in the default graph mode, the page account checked after every step; with
    ``cascade`` a group is 2 requests sharing 8 tokens (small sizes). The start-up's cascade steps (the warm-up's
    shared-prefix batches: one request count, with and without a request outside the group, on the CPU) are
    checked, then the counters ``calls`` and ``backend.cascade.steps`` start again from 0."""
    calls[0] = 0
    options = {"compiler": "eager", "decode_batch_sizes": (2, 8), "extend_token_sizes": (8, 64)}  # few captures
    llm = LLM(model, attn_backend=backend, compile=compile, compile_options=options, max_batch_size=8,
              max_num_tokens=64, max_context=64, page_size=PAGE, device="cpu", cascade_decode=cascade)
    assert llm.step_runner.graph_mode is GraphMode.FULL_AND_PIECEWISE
    assert (llm.prefix_groups is not None) == cascade
    warm = 2 if cascade else 0
    assert llm.backend.cascade.steps == warm and calls[0] == warm * len(model.model.layers)
    llm.backend.cascade.steps = calls[0] = 0
    if cascade:
        llm.prefix_groups.min_requests, llm.prefix_groups.min_tokens = 2, 8
    params = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    before = compile_counters.snapshot()
    reqs = [llm.add_request(p, params) for p in PROMPTS]
    while llm.has_work():
        llm.step()
        page_account(llm.kv_cache)
    delta = compile_counters.delta(before)
    assert delta.get("graphs_seen", 0) == 0 and delta.get("recompiles", 0) == 0, delta
    account = page_account(llm.kv_cache)
    assert account.running == 0 and account.free + account.cached_only == account.total
    return llm, [r.output_ids for r in reqs]


@pytest.mark.parametrize("compile", [False, True], ids=["breakable", "piecewise"])
def test_cascade_in_the_default_graph_mode_matches_off_and_hf(models, cascade_calls: list[int],
                                                              compile: bool) -> None:  # noqa: ANN001
    model, refs = models
    outs = {}
    for on in (False, True):
        llm, outs[on] = run_engine(model, "triton", compile, on, cascade_calls)
        stats = llm.step_runner.runner.stats
        steps = llm.backend.cascade.steps
        if not on:
            assert cascade_calls[0] == steps == stats.shared_prefix_runs == 0
            continue
        # every shared-prefix step came through the graph runner's piecewise route, none ran eagerly
        assert steps >= N_NEW - 1 and stats.shared_prefix_runs == steps
        assert cascade_calls[0] == steps * len(model.model.layers)
        assert stats.runs[GraphMode.NONE.value] == 0
    assert outs[True] == outs[False] == refs


def test_decode_with_groups_leaves_the_full_graph_for_the_pieces(models, cascade_calls: list[int],
                                                                  full_decode_backend: str) -> None:  # noqa: ANN001
    model, refs = models
    outs, runs = {}, {}
    for on in (False, True):
        llm, outs[on] = run_engine(model, full_decode_backend, True, on, cascade_calls)
        stats = llm.step_runner.runner.stats
        runs[on] = stats.runs[GraphMode.FULL.value], stats.shared_prefix_runs, llm.backend.cascade.steps
        assert cascade_calls[0] == runs[on][2] * len(model.model.layers)
    decode_steps = runs[False][0]
    assert decode_steps >= N_NEW - 1 and runs[False][1:] == (0, 0)  # without groups every decode step is full
    full, shared, steps = runs[True]
    assert steps == shared >= N_NEW - 1  # the steps with a group ran piecewise, through the cascade kernels
    assert full + shared == decode_steps  # and only those left the full graph
    assert outs[True] == outs[False] == refs
