"""Engine with HF models (fp32, CPU): greedy ``LLM.generate`` tokens equal the stock model's greedy
``generate`` tokens (eager attention) for prompts of different lengths, in every graph mode, for three families."""

from __future__ import annotations


import pytest

from tests.hf.hf_tiny_models import build_pair, hf_greedy  # noqa: E402

from compile_attn.engine import LLM, SamplingParams  # noqa: E402

PROMPTS = [[(5 * i + 3 * j + 1) % 96 for j in range(n)] for i, n in enumerate([3, 12, 7, 20])]
N_NEW = 6


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma2"])
def family_models(request: pytest.FixtureRequest):  # noqa: ANN201
    # HF's eager attention: the reference semantics. Not the default implementation: transformers 5.17 picks SDPA
    # for Gemma2, which does not apply its attention softcap (its logits differ from eager's; 5.24 picks eager).
    ours, stock = build_pair(request.param, attn="eager")
    refs = [hf_greedy(stock, p, N_NEW) for p in PROMPTS]
    return request.param, ours, refs


@pytest.mark.parametrize(
    ("graph_mode", "compile"),
    [("none", False), ("full", False), ("breakable", False), ("piecewise", True), ("full_and_piecewise", True)],
)
def test_greedy_equals_hf_generate_in_every_graph_mode(family_models, graph_mode: str, compile: bool) -> None:  # noqa: ANN001
    family, model, refs = family_models
    llm = LLM(model, graph_mode=graph_mode, compile=compile, compile_options={"compiler": "eager"},
              max_batch_size=4, max_num_tokens=32, max_context=64, page_size=4, device="cpu")
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs, f"{family} in {graph_mode}"
