"""Overlap scheduling on the GPU: steady-state engine steps make no CPU-GPU synchronisation except the one wait per
step on the previous step's tokens (``torch.cuda.set_sync_debug_mode("error")`` raises on any other), for greedy
and sampled batches, decode-only and mixed with prefills; and overlapped greedy outputs equal the serial loop's."""

from __future__ import annotations

import pytest
import torch

from compile_attn.engine import LLM, SamplingParams
from tests.engine.bf16_reference import small_llama

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def llm() -> LLM:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return LLM(small_llama(), attn_backend="triton", max_batch_size=16, max_num_tokens=256, kv_cache_tokens=8192,
               max_context=1024)


PROMPTS = [[(13 * i + 7 * j) % 1024 for j in range(n)] for i, n in enumerate([5, 33, 17, 64, 2, 120, 40, 9])]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=64, ignore_eos=True),
    SamplingParams(max_tokens=64, temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True),
    SamplingParams(max_tokens=64, temperature=0.8, seed=3, ignore_eos=True),
], ids=["greedy", "top_k_top_p", "seeded"])
def test_steady_steps_make_no_hidden_sync(llm: LLM, params: SamplingParams) -> None:
    first = [llm.add_request(p, params) for p in PROMPTS[:6]]
    for _ in range(4):  # prefills, then every request decodes
        llm.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(24):
            if i == 8:  # a prefill joins the decoding batch: mixed steps too
                llm.add_request(PROMPTS[7], params)
            llm.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    while llm.has_work():
        llm.step()
    assert all(r.num_output_known == 64 for r in first)
    assert llm.kv_cache.available_tokens == llm.kv_cache.allocator.num_pages * llm.kv_cache.page_size


def test_overlapped_greedy_equals_serial(llm: LLM) -> None:
    # One length for all: both loops then run the same batches (a request that stops earlier than the others
    # rides along one more step with overlap, and another batch size may round differently in bf16).
    params = [SamplingParams(max_tokens=48, ignore_eos=True)] * len(PROMPTS)
    outs = {}
    for overlap in (False, True):
        llm.overlap = overlap
        outs[overlap] = [o.token_ids for o in llm.generate(PROMPTS, params)]
    llm.overlap = True
    assert outs[True] == outs[False]
    assert [len(t) for t in outs[True]] == [48] * len(PROMPTS)
