"""bench_targets on a toy model on the CPU: the one-prompt prefill runs one fresh prompt per repeat (no prefix cache
hit) and leaves the engine idle with its KV pool fresh; the decode step times steady decode steps of the whole batch
(counted in the LLM's own step counters) with the context capped to fit; the targets are the ratios of the numbers
given, None where one is missing."""

from __future__ import annotations

import pytest
import torch

from compile_attn.batch import ForwardMode
from compile_attn.bench.workloads import fixed
from compile_attn.engine import LLM
from compile_attn.models import ToyDecoder, ToyDecoderConfig
from compile_attn.bench import serving_targets as bench_targets

CFG = ToyDecoderConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                       intermediate_size=64)


@pytest.fixture(scope="module")
def llm() -> LLM:
    torch.manual_seed(0)
    llm = LLM(ToyDecoder(CFG).eval(), max_batch_size=4, max_num_tokens=64, kv_cache_tokens=2048, max_context=128,
              page_size=1, graph_mode="none", compile=False, device="cpu")
    llm.fresh_kv_tokens = llm.kv_cache.available_tokens
    return llm


def idle_and_fresh(llm: LLM) -> bool:
    """Nothing running or queued, and every KV slot free once the prefix cache lets go of what it keeps."""
    llm.kv_cache.prefix_cache.clear()
    return not llm.has_work() and llm.kv_cache.available_tokens == llm.fresh_kv_tokens


def test_prefill_ms_runs_fresh_prompts(llm: LLM) -> None:
    cache = llm.kv_cache.prefix_cache
    hits, steps = cache.num_hit_tokens, llm.num_steps
    p = bench_targets.prefill_ms(llm, 10, 0.0, repeats=3)
    assert p["prompt_len"] == 10 and len(p["samples_ms"]) == 3
    assert sorted(p["samples_ms"])[1] == p["median_ms"] > 0
    assert llm.num_steps - steps == 4  # one prefill step per prompt, the untimed one included
    assert cache.num_hit_tokens == hits and idle_and_fresh(llm)
    assert bench_targets.prefill_ms(llm, 1000, 0.0, repeats=1)["prompt_len"] == 127  # below max_context


def test_decode_step_ms_times_the_whole_batch(llm: LLM) -> None:
    before = llm.steps_by_mode[ForwardMode.DECODE]
    d = bench_targets.decode_step_ms(llm, 3, 20, 0.0, steps=10, windows=5)
    assert (d["batch_size"], d["running"], d["context_len"], d["steps_per_window"]) == (3, 3, 20, 2)
    assert len(d["windows_ms"]) == 5 and d["median_ms"] > 0
    assert llm.steps_by_mode[ForwardMode.DECODE] - before >= 8 + 5 * 2  # warm-up and timed steps all decode
    assert idle_and_fresh(llm)
    capped = bench_targets.decode_step_ms(llm, 2, 500, 1.0, steps=100, windows=5)
    assert capped["context_len"] == 64 and capped["running"] == 2
    assert 64 + 8 + 5 * capped["steps_per_window"] <= 128 and idle_and_fresh(llm)


def test_denominators_use_the_workload_medians(llm: LLM) -> None:
    w = fixed(num_seqs=3, prompt_len=12, output_len=10, vocab_size=97)
    den = bench_targets.denominators(llm, w, 2)
    assert den["prefill"]["prompt_len"] == 12
    assert (den["decode_step"]["batch_size"], den["decode_step"]["context_len"]) == (2, 12 + 5)


def test_targets_are_ratios_with_bounds() -> None:
    rates = [dict(request_rate="inf", output_tok_per_s=900.0, itl_p50_ms=9.0, ttft_p50_ms=90.0),
             dict(request_rate=2.0, rate_name="half", output_tok_per_s=450.0, itl_p50_ms=5.0, ttft_p50_ms=30.0)]
    den = dict(prefill=dict(median_ms=10.0), decode_step=dict(median_ms=4.0))
    t = bench_targets.targets(dict(rates=rates, offline=dict(output_tok_s=1000.0), denominators=den))
    assert t["server_vs_offline"] == dict(value=0.9, bound=0.9, met=True)
    assert t["itl_p50_over_decode_step"] == dict(value=1.25, bound=1.3, met=True)
    assert t["ttft_p50_over_prefill"] == dict(value=3.0, bound=2.0, met=False)
    bare = bench_targets.targets(dict(rates=rates[:1]))
    assert all(x["value"] is None and x["met"] is None for x in bare.values())
