"""The engine's shared-prefix (cascade) decode on a GPU in the default graph mode (full decode graphs, piecewise
graphs for the rest): decode steps whose requests share the system prompt leave the full decode graph for the
piecewise one and run the cascade kernels (counted), with the greedy tokens of the engine without it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from compile_attn.attention.triton import cascade as triton_cascade
from compile_attn.engine import LLM, SamplingParams
from compile_attn.graph_mode import GraphMode
from compile_attn.kv.page_account import page_account

pytestmark = pytest.mark.gpu

SYSTEM = [(7 * j + 3) % 512 for j in range(300)]
PROMPTS = [SYSTEM + [(5 * i + j) % 512 for j in range(1 + i % 7)] for i in range(24)]
PROMPTS.append([(11 * j + 2) % 512 for j in range(40)])  # shares nothing: in no group
N_NEW = 8


def test_cascade_decode_in_full_and_piecewise_matches_off(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="compile_attn", dtype=torch.float32).eval()
    calls = [0]
    real = triton_cascade.cascade_decode_fwd

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_cascade, "cascade_decode_fwd", counted)
    outs, runs = {}, {}
    for on in (False, True):
        llm = LLM(model, attn_backend="triton", max_batch_size=32, max_num_tokens=2048, max_context=512,
                  kv_cache_tokens=32 * 512, dtype="float32", device="cuda", cascade_decode=on)
        assert llm.step_runner.runner.plan.decode is GraphMode.FULL
        calls[0] = llm.backend.cascade.steps = 0
        outs[on] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=N_NEW,
                                                                                           ignore_eos=True))]
        stats = llm.step_runner.runner.stats
        runs[on] = stats.runs[GraphMode.FULL.value], stats.shared_prefix_runs, llm.backend.cascade.steps, calls[0]
        account = page_account(llm.kv_cache)
        assert account.running == 0 and account.free + account.cached_only == account.total
    full_off, shared_off, _, calls_off = runs[False]
    full_on, shared_on, steps_on, calls_on = runs[True]
    assert shared_off == calls_off == 0 and full_off >= N_NEW // 2
    assert shared_on == steps_on >= N_NEW // 2 and calls_on == steps_on * cfg.num_hidden_layers
    assert full_on + shared_on == full_off
    assert outs[True] == outs[False]
