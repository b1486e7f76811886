"""Presence / frequency / repetition penalties with speculative decoding (CPU, fp32): greedy outputs identical with
speculation on and off (and equal to a float64 penalised recompute) for chains and trees of a replaying proposer
(drafts that are the penalised tokens themselves, some wrong), prompt lookup and a draft model, in the graph modes
the speculative tests use; seeded samples identical; the statistics after accepts and rejects equal a recount from
the requests' tokens at every step; ``drafts_before`` against its definition."""

from __future__ import annotations

import pytest
import torch

from compile_attn.engine import LLM, SamplingParams
from compile_attn.engine.execution.speculative.penalties import drafts_before
from compile_attn.engine.execution.speculative.speculator import SampleRows
from compile_attn.models import ToyDecoder
from tests.engine.execution.speculative.test_draft_model_engine import draft_config
from tests.engine.execution.speculative.test_draft_trees import NGRAM_TREE, noisy_copy
from tests.engine.execution.speculative.test_speculative_engine import CFG, NGRAM, PROMPTS, make_llm
from tests.greedy_reference import last_logits_by_recompute

# (presence, frequency, repetition): each alone, and all three; strong enough that a row missing a draft before it
# picks another token.
KINDS = {"presence": (0.6, 0.0, 1.0), "frequency": (0.0, 0.4, 1.0), "repetition": (0.0, 0.0, 1.3),
         "combined": (0.3, 0.2, 1.15)}


def params_of(kind: str, n: int = 14, **kw) -> SamplingParams:
    presence, frequency, repetition = KINDS[kind]
    return SamplingParams(max_new_tokens=n, presence_penalty=presence, frequency_penalty=frequency,
                          repetition_penalty=repetition, **kw)


def mixed_params(n: int = 14) -> list[SamplingParams]:
    """One request per kind and one without penalties, for PROMPTS (different lengths)."""
    return [params_of(k, n) for k in KINDS] + [SamplingParams(max_new_tokens=n)]


@pytest.fixture(scope="module")
def model() -> ToyDecoder:
    torch.manual_seed(0)
    return ToyDecoder(CFG).eval()


@pytest.fixture(scope="module")
def references(model: ToyDecoder) -> list[list[int]]:
    """``penalised_by_recompute`` of the first prompts, one per kind of ``mixed_params()``."""
    return [penalised_by_recompute(model, p, 14, *KINDS[k]) for p, k in zip(PROMPTS, KINDS)]


def penalised_by_recompute(model: ToyDecoder, prompt: list[int], n: int, presence: float, frequency: float,
                           repetition: float) -> list[int]:
    """float64 reference: each token from a fresh full prefill, penalised by the OpenAI / vLLM definition."""
    tokens = list(prompt)
    for _ in range(n):
        logits = last_logits_by_recompute(model, tokens).double()
        out = tokens[len(prompt):]
        for t in set(tokens):
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


class ReplayProposer:
    """Test-only prompt-lookup stand-in: proposes each request's known continuation (``sequences``: prompt + output
    of a run without speculation), every ``wrong_every``-th position changed to a wrong token, so verify steps accept
    and reject. A row then differs from plain decoding wherever its statistics miss a draft before it (or count a
    sibling's): the drafts are the very tokens penalties act on. Trees: the chain, and a wrong sibling per depth."""

    def __init__(self, sequences: list[list[int]], k: int, wrong_every: int = 5) -> None:
        self.sequences, self.k, self.wrong_every = sequences, k, wrong_every

    def propose(self, token_ids, max_tokens: int | None = None) -> list[int]:  # noqa: ANN001
        ids = list(token_ids)
        n = self.k if max_tokens is None else min(self.k, max_tokens)
        for s in self.sequences:
            if s[: len(ids)] == ids:
                return [(t + 1) % CFG.vocab_size if (len(ids) + j) % self.wrong_every == 0 else t
                        for j, t in enumerate(s[len(ids) : len(ids) + n])]
        return []

    def propose_tree(self, token_ids, max_depth: int, topk: int, max_nodes: int) -> tuple[list[int], list[int]]:  # noqa: ANN001
        drafts, parents = [], []
        for d, t in enumerate(self.propose(token_ids, max_depth)):
            if len(drafts) + 2 > max_nodes:
                break
            parent = 2 * d - 2  # the chain node one depth up (-2 + 0 = -2 -> -1 at depth 0)
            drafts += [t, (t + 2) % CFG.vocab_size]
            parents += [max(parent, -1)] * 2
        return drafts, parents


def run_both(model: torch.nn.Module, spec: dict, params: list[SamplingParams] | SamplingParams, *,
             replay: bool = False, **kw) -> tuple[list[list[int]], LLM]:
    """Outputs with speculation off and on (asserted equal), and the speculative engine; ``replay``: drafts from
    ``ReplayProposer`` (the run without speculation's outputs, some changed) instead of prompt lookup."""
    plain = [o.token_ids for o in make_llm(model, **kw).generate(PROMPTS, params)]
    llm = make_llm(model, speculative_config=spec, **kw)
    if replay:
        llm.speculator.proposer = ReplayProposer([p + o for p, o in zip(PROMPTS, plain)], spec["num_speculative_tokens"])
    outs = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert outs == plain
    return outs, llm


def assert_drafts_checked(llm: LLM) -> None:
    """Drafts were verified, some accepted and some rejected."""
    s = llm.speculator.stats
    assert 0 < s.accepted_tokens < s.draft_tokens, s


@pytest.mark.parametrize(("graph_mode", "compile"), [("none", False), ("full", False), ("breakable", False),
                                                      ("piecewise", True), ("full_and_piecewise", True)])
def test_greedy_with_penalties_identical_with_chains_in_every_graph_mode(model, references, graph_mode,  # noqa: ANN001
                                                                          compile) -> None:  # noqa: ANN001
    options = {"compiler": "eager", "verify": True} if compile else {"verify": True}
    outs, llm = run_both(model, NGRAM, mixed_params(), replay=True, graph_mode=graph_mode, compile=compile,
                         compile_options=options)
    assert outs[:len(KINDS)] == references
    assert_drafts_checked(llm)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("overlap", [True, False])
def test_each_penalty_alone_identical_with_chains(model, kind: str, overlap: bool) -> None:  # noqa: ANN001
    _, llm = run_both(model, NGRAM, params_of(kind, 20), replay=True, overlap=overlap)
    assert_drafts_checked(llm)


def test_penalties_that_favour_repeats_identical_with_prompt_lookup(model) -> None:  # noqa: ANN001
    """Negative penalties keep the text repeating, so prompt lookup proposes and is often right."""
    params = [SamplingParams(max_new_tokens=20, presence_penalty=p, frequency_penalty=f, repetition_penalty=r)
              for p, f, r in [(-0.5, 0, 1), (0, -0.3, 1), (0, 0, 0.8), (-0.3, 0.2, 0.9), (0.1, 0, 1.05)]]
    _, llm = run_both(model, NGRAM, params)
    assert_drafts_checked(llm)


@pytest.mark.parametrize(("graph_mode", "compile"), [("none", False), ("full", False), ("full_and_piecewise", True)])
def test_greedy_with_penalties_identical_with_a_draft_model(model, graph_mode, compile) -> None:  # noqa: ANN001
    # A draft close to the target, so its drafts are often accepted and sometimes rejected.
    options = {"compiler": "eager"} if compile else None
    _, llm = run_both(model, draft_config(noisy_copy(model, 0.05)), mixed_params(), graph_mode=graph_mode,
                      compile=compile, compile_options=options)
    assert_drafts_checked(llm)


@pytest.mark.parametrize("method", ["replay", "draft_model"])
def test_greedy_with_penalties_identical_with_trees(model, method: str) -> None:  # noqa: ANN001
    spec = NGRAM_TREE if method == "replay" else {"method": "draft_model", "model": noisy_copy(model, 0.05),
                                                  "num_speculative_tokens": 3, "topk": 3, "num_draft_tokens": 7}
    _, llm = run_both(model, spec, mixed_params(16), replay=method == "replay", max_num_tokens=64)
    assert_drafts_checked(llm)
    assert llm.speculator.stats.tree_verified > 0


@pytest.mark.parametrize("spec", ["replay", "draft_model", "tree"])
def test_seeded_samples_with_penalties_identical(model, spec: str) -> None:  # noqa: ANN001
    config = {"replay": NGRAM, "draft_model": draft_config(noisy_copy(model, 0.05)),
              "tree": {"method": "draft_model", "model": noisy_copy(model, 0.05), "num_speculative_tokens": 3,
                       "topk": 3}}[spec]
    params = [params_of(k, 16, temperature=t, seed=s)
              for k, t, s in zip(KINDS, (0.3, 0.6, 0.2, 0.8), (1, 2, 3, 4))] + [params_of("combined", 16, seed=5,
                                                                                          temperature=1.2, top_k=8)]
    _, llm = run_both(model, config, params, replay=spec == "replay", max_num_tokens=64)
    assert llm.speculator.stats.accepted_tokens > 0


def recount(r, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Output counts and prompt mask of request ``r`` from its token ids (plain Python)."""
    counts, mask = [0] * vocab, [False] * vocab
    for t in r.token_ids[len(r.prompt_ids):]:
        counts[t] += 1
    for t in r.prompt_ids:
        mask[t] = True
    return torch.tensor(counts, dtype=torch.int32), torch.tensor(mask)


@pytest.mark.parametrize("spec", ["chain", "tree"])
def test_statistics_after_accepts_and_rejects_equal_a_recount(model, spec: str) -> None:  # noqa: ANN001
    config = NGRAM if spec == "chain" else NGRAM_TREE
    params = mixed_params(20)
    plain = [o.token_ids for o in make_llm(model).generate(PROMPTS, params)]
    llm = make_llm(model, speculative_config=config, overlap=False, max_num_tokens=64)
    llm.speculator.proposer = ReplayProposer([p + o for p, o in zip(PROMPTS, plain)], 3)
    reqs = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    checked = 0
    while llm.has_work():
        llm.step()
        for r in llm.scheduler.running:
            if r.params.has_penalties and r.penalty_row == r.row and r.num_output:
                counts, mask = recount(r, CFG.vocab_size)
                assert torch.equal(llm.penalties.output_counts[r.row], counts), (r.request_id, r.token_ids)
                assert torch.equal(llm.penalties.prompt_mask[r.row], mask)
                checked += 1
    assert checked > 10 and [r.output_ids for r in reqs] == plain
    assert_drafts_checked(llm)


def test_drafts_before_follow_each_rows_path() -> None:
    """A plain row, a chain of 3 and a tree (root -> 5 -> {6, 7 -> 8}): each row's preceding drafts on its path."""
    rows = SampleRows(reqs=[None] * 10)  # type: ignore[list-item]
    rows.spans = [(None, 0, [], None), (None, 1, [1, 2, 3], None), (None, 5, [5, 6, 7, 8], [-1, 0, 0, 2])]
    assert drafts_before(rows) == [[], [], [1], [1, 2], [1, 2, 3], [], [5], [5, 6], [5, 7], [5, 7, 8]]
