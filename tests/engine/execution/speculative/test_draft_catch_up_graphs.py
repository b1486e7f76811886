"""A draft model's catch-up step in full graphs: in steady state it feeds each request one or two tokens, which the
draft's runner runs as a chain verify batch in its verify graphs (a torch_native test double with a verify mode on
the CPU, triton on a GPU) or, where the backend has no verify mode, as decode rows in its full decode graphs. The
proposals (every draft of every step) must equal those of the extend route (``CATCH_UP_TOKENS = 0``), greedy outputs
must equal plain greedy decoding recomputed from scratch, every small catch-up must have replayed a full graph
(the draft runner's statistics), and nothing may capture or compile on the first speculative traffic."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.graph_runner.gr_helpers import VerifyModeNative
from tests.greedy_reference import greedy_by_recompute

import compile_attn.engine.execution.speculative.draft_model as draft_model
from compile_attn.compiler import compile_counters
from compile_attn.engine import LLM, SamplingParams
from compile_attn.engine.execution.speculative.draft_model import DraftModelProposer
from compile_attn.models import ToyDecoder, ToyDecoderConfig

# No sliding window (a verify mode needs every layer to see the whole sequence).
CFG = ToyDecoderConfig(vocab_size=53, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64)
PROMPTS = [[(7 * i + j) % 11 for j in range(n)] for i, n in enumerate([3, 17, 9, 30])]
N_NEW = 16
_CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU test (the engine runs on the CPU)")


@pytest.fixture(scope="module")
def model() -> ToyDecoder:
    torch.manual_seed(0)
    return ToyDecoder(CFG).eval()


@pytest.fixture(scope="module")
def draft(model: ToyDecoder) -> ToyDecoder:
    """The target's weights with noise: right often enough that some steps accept every draft (two-token
    catch-ups), wrong often enough that others accept few (one-token catch-ups)."""
    torch.manual_seed(1)
    d = copy.deepcopy(model)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    return d


@pytest.fixture(scope="module")
def reference(model: ToyDecoder) -> list[list[int]]:
    """Plain greedy decoding, recomputed from scratch."""
    return [greedy_by_recompute(model, prompt, N_NEW) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def extend_route(model: ToyDecoder, draft: ToyDecoder, reference: list[list[int]]) -> tuple[list, list]:
    """(proposals, batches) with every catch-up on the extend route (no verify graphs, mixed batches)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(DraftModelProposer, "CATCH_UP_TOKENS", 0)
        _, proposals, batches = _run(model, draft, reference, graph_mode="full", compile=False)
    return proposals, batches


def _run(model: ToyDecoder, draft: ToyDecoder, reference: list[list[int]], **kw) -> tuple[LLM, list, list]:
    """Greedy generation with the draft, checked against ``reference``; (engine, every proposal, the draft runner's
    batches as (mode, tokens per request, whether a full verify graph took it))."""
    llm = LLM(model, max_batch_size=4, max_num_tokens=64, max_context=64, page_size=4, device="cpu",
              speculative_config={"method": "draft_model", "model": copy.deepcopy(draft),
                                  "num_speculative_tokens": 3}, overlap=False, **kw)
    proposer = llm.speculator.draft
    runner = proposer.runner.runner
    proposals, batches = [], []
    propose, run = proposer.propose, runner.run

    def record_propose(requests, rooms, tree=None):  # noqa: ANN001, ANN202
        out = propose(requests, rooms, tree)
        proposals.append([(r.request_id, tokens) for r, (tokens, _) in zip(requests, out)])
        return out

    def record_run(fb, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        batches.append((fb.forward_mode.name, list(fb.extend_seq_lens_cpu), runner.verify_route(fb) is not None))
        return run(fb, *args, **kwargs)

    proposer.propose, runner.run = record_propose, record_run
    outs = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW))]
    assert outs == reference
    return llm, proposals, batches


def _small_catch_ups(batches: list) -> list:
    """The catch-up steps that fed every request one or two tokens, not all one (a decode step)."""
    return [b for b in batches if b[0] != "DECODE" and max(b[1]) <= 2]


@_CPU
@pytest.mark.parametrize("verify_mode", [True, False], ids=["verify-graphs", "decode-rows"])
def test_catch_up_in_full_graphs_proposes_what_the_extend_route_does(model, draft, reference, extend_route,  # noqa: ANN001
                                                                     verify_mode, monkeypatch) -> None:
    if verify_mode:
        monkeypatch.setattr(draft_model, "create_backend", lambda name, kv, layers: VerifyModeNative(kv, layers))
    proposals_old, batches_old = extend_route
    assert _small_catch_ups(batches_old) and all(b[0] != "TARGET_VERIFY" for b in batches_old)
    llm, proposals, batches = _run(model, draft, reference, graph_mode="full", compile=False)
    assert proposals == proposals_old  # every draft of every step
    runner = llm.speculator.draft.runner.runner
    small = _small_catch_ups(batches)
    assert any(max(b[1]) == 2 and min(b[1]) == 1 for b in small)  # one and two tokens in one step
    assert small and all(b[0] == "TARGET_VERIFY" for b in small)  # every one of them as a chain verify batch
    eager = sum(1 for b in batches if b[0] not in ("DECODE", "TARGET_VERIFY"))  # the prompts' first catch-ups
    assert runner.stats.runs["none"] == eager and runner.stats.runs["full"] == len(batches) - eager
    if verify_mode:
        assert runner.verify_tokens == 2 and runner.verify_buckets == (1, 2, 4) and runner.stats.verify_graphs == 3
        assert all(b[2] for b in small) and runner.stats.verify_runs == len(small)
        assert llm.speculator.draft.runner.runner.backend.verify_forwards > 0
    else:  # as decode rows: the decode graphs reach max_batch_size x 2 rows
        assert runner.verify_buckets == () and runner.decode_buckets[-1] == 8 and runner.stats.verify_runs == 0


@_CPU
def test_nothing_captures_or_compiles_on_first_catch_up_traffic(model, draft, reference, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(draft_model, "create_backend", lambda name, kv, layers: VerifyModeNative(kv, layers))
    torch._dynamo.reset()
    llm = LLM(model, max_batch_size=4, max_num_tokens=64, max_context=64, page_size=4, device="cpu",
              graph_mode="full_and_piecewise", compile=True, compile_options={"compiler": "eager"},
              speculative_config={"method": "draft_model", "model": copy.deepcopy(draft),
                                  "num_speculative_tokens": 3}, overlap=False)
    stats = llm.speculator.draft.runner.runner.stats
    captures = dict(stats.captures)
    before = compile_counters.snapshot()
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW))
    delta = compile_counters.delta(before)
    assert delta.get("graphs_seen", 0) == 0 and delta.get("recompiles", 0) == 0, delta
    assert dict(stats.captures) == captures and stats.verify_runs > 0
    assert [o.token_ids for o in outs] == reference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_draft_catch_up_replays_triton_verify_graphs_on_a_gpu() -> None:
    """bf16 on a GPU with the triton backend: tokens equal HF's greedy ones up to the first near-tie with the catch-up
    in the draft's verify graphs and on the extend route, the verify graphs replayed, and the drafts as good."""
    from tests.engine.bf16_reference import greedy_up_to_first_tie, small_llama

    model = small_llama()
    prompts = [([(13 * i + 7 * j) % 1024 for j in range(8)] * 4)[:n] for i, n in enumerate([9, 24, 32, 17])]
    refs = [greedy_up_to_first_tie(model, p, 24) for p in prompts]
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * p.float().std() * torch.randn_like(p))

    def run() -> LLM:
        llm = LLM(model, attn_backend="triton", max_batch_size=8, max_context=256, max_num_tokens=256,
                  overlap=False, speculative_config={"method": "draft_model", "model": copy.deepcopy(draft),
                                                     "num_speculative_tokens": 4})
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
        for out, (ref, first_tie) in zip(outs, refs):
            assert out.token_ids[:first_tie] == ref[:first_tie], f"first undecidable position {first_tie}"
        return llm

    with pytest.MonkeyPatch.context() as m:
        m.setattr(DraftModelProposer, "CATCH_UP_TOKENS", 0)
        old = run()
    llm = run()
    runner = llm.speculator.draft.runner.runner
    assert runner.plan.decode.value == "full" and runner.verify_tokens == 2 and runner.stats.verify_graphs > 0
    assert runner.stats.verify_runs > 0 and runner.backend.verify.steps > 0
    assert old.speculator.draft.runner.runner.stats.verify_runs == 0
    # bf16: the routes' logits may differ in the last bits, so drafts can part at a near-tie (and the steps with
    # them); the drafts must be as good: about as many accepted
    new_rate, old_rate = (s.accepted_tokens / s.draft_tokens for s in (llm.speculator.stats, old.speculator.stats))
    assert new_rate >= 0.8 * old_rate, (new_rate, old_rate)
