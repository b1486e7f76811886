"""After ``LLM(...)`` start-up with ``compile=True``, serving compiles nothing: a workload with decode, extend and
mixed steps, prompts longer than the largest token bucket and decode batches larger than the largest decode
bucket makes no Dynamo compile or recompile and no piece compile or capture (CPU; the GPU twin also counts
Triton and Inductor kernel builds). Greedy tokens still equal an independent recompute."""

from __future__ import annotations


import pytest
import torch
from tests.engine.first_traffic import assert_every_path_taken, every_path_traffic, generate_recorded
from tests.greedy_reference import greedy_by_recompute

from compile_attn.engine import LLM
from compile_attn.models import ToyDecoder, ToyDecoderConfig

CFG = ToyDecoderConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64, sliding_window=11)
OPTIONS = {"decode_batch_sizes": (1, 2, 4), "extend_token_sizes": (8, 16, 32)}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # other tests' compiled frames of the same model code would change the counts
    yield
    torch._dynamo.reset()


def _engine(model, tmp_path, compiler: str) -> LLM:  # noqa: ANN001
    return LLM(model, max_batch_size=6, max_num_tokens=40, kv_cache_tokens=1024, max_context=100, device="cpu",
               graph_mode="full_and_piecewise", compile=True,
               compile_options={**OPTIONS, "compiler": compiler, "cache_dir": str(tmp_path)})


def test_toy_decoder_serves_without_compiling(tmp_path) -> None:
    torch.manual_seed(0)
    model = ToyDecoder(CFG).eval()
    llm = _engine(model, tmp_path, "inductor")
    traffic = every_path_traffic(CFG.vocab_size, longest_prompt=50, num_requests=10)
    outs, builds, log = generate_recorded(llm, traffic)
    assert_every_path_taken(llm, log)
    assert not builds.dynamo.get("unique_graphs") and not builds.compile_attn, builds
    for prompt, params, out in zip(traffic.prompts, traffic.params, outs):
        if params.temperature == 0:
            assert out.token_ids == greedy_by_recompute(model, prompt, params.max_new_tokens)


def test_hf_llama_serves_without_compiling(tmp_path) -> None:
    from tests.hf.hf_tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="compile_attn").eval()
    llm = _engine(model, tmp_path, "eager")
    traffic = every_path_traffic(model.config.vocab_size, longest_prompt=50, num_requests=10, seed=1)
    _, builds, log = generate_recorded(llm, traffic)
    assert_every_path_taken(llm, log)
    assert not builds.dynamo.get("unique_graphs") and not builds.compile_attn, builds
