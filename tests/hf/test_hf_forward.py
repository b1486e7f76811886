"""HF models with attn_implementation="compile_attn" against stock HF, on CPU in float32.

Inside a forward context: ragged batches with cached prefixes and a decode step must give the logits
HF eager gives for each request run alone. Outside a context: the patched model must behave exactly
like the stock model (forward with padding, and greedy generate).
"""

from __future__ import annotations

import pytest
import torch
from tests.hf.hf_steps import random_sequences, run_scenario
from tests.hf.hf_tiny_models import FAMILIES, build_pair
from tests.reference import max_rel_error

from compile_attn import ForwardBatch, create_backend, forward_context
from compile_attn.hf import HFModelAdapter

TOL = 1e-4


def _check_against_reference(
    ref: torch.nn.Module, sequences: list[torch.Tensor], logits: list[torch.Tensor]
) -> None:
    for i, (seq, got) in enumerate(zip(sequences, logits, strict=True)):
        with torch.no_grad():
            want = ref(seq[None]).logits[0]
        assert got.shape == want.shape
        err = max_rel_error(got, want)
        assert err <= TOL, f"request {i} (length {len(seq)}): relative error {err:.2e} > {TOL}"


@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_steps_match_hf_eager(family: str) -> None:
    ours, ref = build_pair(family, attn="eager")
    adapter = HFModelAdapter(ours)
    kv = adapter.make_kv_cache(max_batch_size=8, max_context=64, kv_cache_tokens=256)
    sequences = random_sequences(adapter.vocab_size, seed=1)
    logits = run_scenario(adapter, kv, "torch_native", adapter.attention_layers(), sequences)
    _check_against_reference(ref, sequences, logits)


def test_page_size_and_logits_indices() -> None:
    """Pages of 4 tokens and ``logits_indices`` (only the sampled tokens' logits)."""
    ours, ref = build_pair("gemma2", attn="eager")
    adapter = HFModelAdapter(ours)
    kv = adapter.make_kv_cache(max_batch_size=4, max_context=64, kv_cache_tokens=256, page_size=4)
    backend = create_backend("torch_native", kv, adapter.attention_layers())
    seqs = random_sequences(adapter.vocab_size, seed=3)[:2]
    rows = [kv.alloc_request() for _ in seqs]
    lens = [len(s) for s in seqs]
    fb = ForwardBatch.build(
        req_pool_indices=rows,
        prefix_lens=[0, 0],
        extend_lens=lens,
        out_cache_loc=kv.alloc_extend(rows, lens),
        input_ids=torch.cat(seqs),
    )
    backend.init_forward_metadata(fb)
    last = torch.tensor([lens[0] - 1, lens[0] + lens[1] - 1])
    with torch.no_grad(), forward_context(fb, backend):
        got = adapter(fb.input_ids, fb.positions, logits_indices=last)
    assert got.shape == (2, adapter.vocab_size)
    with torch.no_grad():
        for i, seq in enumerate(seqs):
            assert max_rel_error(got[i], ref(seq[None]).logits[0, -1]) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_outside_context_equals_stock(family: str) -> None:
    """No forward context: the same calls as stock HF (SDPA, or eager for Gemma2), padding included."""
    ours, stock = build_pair(family, attn="stock")
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, ours.config.vocab_size, (2, 20), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding on the second row; row length 20 > window 8
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask).logits
        want = stock(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        got_gen = ours.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        want_gen = stock.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(got_gen, want_gen)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"])
def test_hidden_states_then_compute_logits_equals_the_full_forward(family: str) -> None:
    """The engine runs the decoder in graphs and the LM head (with Gemma's final softcap) on sampled rows."""
    from compile_attn import KVCache, create_backend, forward_context
    from compile_attn.batch import ForwardBatch
    from compile_attn.hf import HFModelAdapter

    ours, _ = build_pair(family)
    adapter = HFModelAdapter(ours)
    layers = adapter.attention_layers()
    kv = KVCache(num_layers=len(layers), num_kv_heads=layers[0].num_kv_heads, head_dim=layers[0].head_dim,
                 max_batch_size=2, max_context=64, kv_cache_tokens=128, dtype=torch.float32)
    backend = create_backend("torch_native", kv, layers)
    rows = [kv.alloc_request(), kv.alloc_request()]
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=[0, 0], extend_lens=[11, 6],
                            out_cache_loc=kv.alloc_extend(rows, [11, 6]), input_ids=torch.arange(17) % 90)
    with torch.no_grad():
        backend.init_forward_metadata(fb)
        with forward_context(fb, backend):
            full = adapter(fb.input_ids, fb.positions)
        backend.init_forward_metadata(fb)
        with forward_context(fb, backend):
            split = adapter.compute_logits(adapter.hidden_states(fb.input_ids, fb.positions)[[10, 16]])
    torch.testing.assert_close(split, full[[10, 16]], rtol=1e-5, atol=1e-5)
