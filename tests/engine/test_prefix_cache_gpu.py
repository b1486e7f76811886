"""Prefix caching on the GPU (bf16): requests that share a prefix read its pages through each backend's page table
(triton, torch_native, flashinfer; page sizes 1 and 16, graphs on) and get HF's greedy tokens up to the first
near-tie, in a first call (later requests reuse earlier ones' prefills) and in a repeated call (every prompt cached
but its last page); the page account holds and the KV pool is whole again at the end."""

from __future__ import annotations

import pytest
import torch

from compile_attn.attention.registry import module_available
from compile_attn.engine import LLM, SamplingParams
from compile_attn.kv.page_account import page_account
from tests.engine.bf16_reference import greedy_up_to_first_tie, small_llama

pytestmark = pytest.mark.gpu

SHARED = [(13 * j + 5) % 1024 for j in range(100)]
PROMPTS = [SHARED + [(7 * i + 3 * j) % 1024 for j in range(n)] for i, n in enumerate([1, 20, 7, 64, 33, 2])]
N_NEW = 16


@pytest.fixture(scope="module")
def model_and_refs():
    """HF's greedy tokens per prompt and the first position a bf16 run may legitimately differ at (the fp32 top-2
    gap there is within twice the bf16 rounding error of the logits)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = small_llama()
    return model, [greedy_up_to_first_tie(model, p, N_NEW) for p in PROMPTS]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", [
    "auto", "torch_native",
    pytest.param("flashinfer", marks=pytest.mark.skipif(not module_available("flashinfer"), reason="needs flashinfer")),
])
def test_shared_prefixes_match_hf_through_every_backend(model_and_refs, backend: str, page_size: int) -> None:  # noqa: ANN001
    model, refs = model_and_refs
    llm = LLM(model, attn_backend=backend, max_batch_size=8, max_context=256, max_num_tokens=128, page_size=page_size)
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    for call in range(2):
        outs = llm.generate(PROMPTS, params)
        for out, (ref, first_tie) in zip(outs, refs):
            assert out.token_ids[:first_tie] == ref[:first_tie], f"call {call}, {llm.backend.name}"
        account = page_account(llm.kv_cache)
        assert account.running == 0 and account.free + account.cached_only == account.total
    cache = llm.kv_cache.prefix_cache
    assert cache.num_hit_tokens >= len(PROMPTS) * (len(SHARED) // page_size * page_size)
    assert sum(t for _, t in refs) >= 8, "too few decidable tokens for the check to say anything"
