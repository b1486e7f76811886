"""The engine with the triton backend's shared-prefix decode (``COMPILE_ATTN_CASCADE_DECODE=1`` with the engine's
``cascade_decode`` option left at None, no graphs): requests behind one system prompt decode through the cascade
kernels (counted) and give the greedy tokens of the engine without it."""

from __future__ import annotations

import pytest
import torch

from compile_attn.engine import LLM, SamplingParams
from compile_attn.models import ToyDecoder, ToyDecoderConfig

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test (the engine runs on the CPU)")

CFG = ToyDecoderConfig(vocab_size=53, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                       intermediate_size=64)


def test_engine_decodes_shared_prefixes_through_the_cascade_kernels(monkeypatch) -> None:
    torch.manual_seed(0)
    toy = ToyDecoder(CFG).eval()
    system = [(7 * j + 3) % 53 for j in range(37)]
    prompts = [system + [(5 * i + j) % 53 for j in range(1 + i % 3)] for i in range(5)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outs, steps = {}, {}
    for on in (False, True):
        monkeypatch.setenv("COMPILE_ATTN_CASCADE_DECODE", "1" if on else "0")
        llm = LLM(toy, attn_backend="triton", graph_mode="none", compile=False, max_batch_size=8, max_num_tokens=256,
                  max_context=64, page_size=4, device="cpu", enable_prefix_cache=True)
        assert (llm.prefix_groups is not None) == on  # the engine looks for the groups of its decode batches
        if on:
            llm.prefix_groups.min_requests, llm.prefix_groups.min_tokens = 2, 8
        outs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        steps[on] = llm.backend.cascade.steps
    assert steps[False] == 0
    assert steps[True] >= 3  # every decode step after the first prompts' prefill shares the system prompt's pages
    assert outs[True] == outs[False]
