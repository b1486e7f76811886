"""Engine on the GPU (bf16): greedy tokens match HF's greedy tokens up to the first near-tie, and a crowd of
concurrent requests all finish with the KV pool back to empty."""

from __future__ import annotations

import pytest
import torch

from compile_attn.attention.registry import module_available
from compile_attn.engine import LLM, SamplingParams
from tests.engine.bf16_reference import greedy_up_to_first_tie, small_llama

pytestmark = pytest.mark.gpu


def _have(module: str) -> bool:
    return module_available(module)


@pytest.mark.parametrize("backend", ["auto", "torch_native"])
@pytest.mark.parametrize("graph_mode", ["full_and_piecewise", "breakable", "none"])
def test_greedy_matches_hf_up_to_the_first_near_tie(graph_mode: str, backend: str) -> None:
    check_greedy_against_hf(graph_mode, backend)


@pytest.mark.parametrize("backend", [
    pytest.param("fa3+flashinfer", marks=pytest.mark.skipif(not (_have("sgl_kernel") and _have("flashinfer")),
                                                             reason="needs sgl_kernel and flashinfer")),
    pytest.param("fa3+triton", marks=pytest.mark.skipif(not _have("sgl_kernel"), reason="needs sgl_kernel")),
    pytest.param("flashinfer+triton", marks=pytest.mark.skipif(not _have("flashinfer"), reason="needs flashinfer")),
    pytest.param("flashinfer", marks=pytest.mark.skipif(not _have("flashinfer"), reason="needs flashinfer")),
    pytest.param("fa3", marks=pytest.mark.skipif(not _have("sgl_kernel"), reason="needs sgl_kernel")),
])
@pytest.mark.parametrize("graph_mode", ["full_and_piecewise", "none"])
def test_hybrid_and_fa3_greedy_match_hf(graph_mode: str, backend: str) -> None:
    check_greedy_against_hf(graph_mode, backend)


def check_greedy_against_hf(graph_mode: str, backend: str) -> None:
    """Greedy tokens equal HF's up to each prompt's first undecidable position (see bf16_reference)."""
    model = small_llama()
    prompts = [[(13 * i + 7 * j) % 1024 for j in range(n)] for i, n in enumerate([5, 33, 17, 64, 2, 120])]
    n_new = 16
    refs = [greedy_up_to_first_tie(model, p, n_new) for p in prompts]
    llm = LLM(model, attn_backend=backend, graph_mode=graph_mode, compile=graph_mode != "none", max_batch_size=8, max_context=256,
              max_num_tokens=256)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=n_new, ignore_eos=True))
    for out, (ref, first_tie) in zip(outs, refs):
        assert out.token_ids[:first_tie] == ref[:first_tie], f"first undecidable position {first_tie}, {llm.backend.name}"
    assert llm.backend.name == backend or backend == "auto"
    compared = sum(first_tie for _, first_tie in refs)
    assert compared >= 8, f"only {compared} decidable tokens ({[t for _, t in refs]}): the check says too little"


def test_256_concurrent_requests_all_finish_and_free_the_pool() -> None:
    model = small_llama(1)
    llm = LLM(model, max_batch_size=64, max_context=512, max_num_tokens=1024, kv_cache_tokens=16384, page_size=16)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1024, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 300, (256,), generator=gen)]
    params = [SamplingParams(max_new_tokens=int(n), temperature=0.7, seed=i, ignore_eos=True)
              for i, n in enumerate(torch.randint(1, 64, (256,), generator=gen))]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [p.max_new_tokens for p in params]
    assert llm.kv_cache.available_tokens == llm.kv_cache.allocator.num_pages * 16
    assert llm.kv_cache.req_to_token_pool.available == 64
