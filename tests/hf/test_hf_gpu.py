"""GPU, bf16: Llama and Gemma2 served through compile_attn against HF on the same GPU.

Tolerance: both our bf16 logits and HF's own bf16 eager logits are compared with an fp32 HF eager
reference of each request run alone; ours must satisfy ``err_ours <= 2 * err_hf + 5e-3`` (relative
error, max |diff| / max |ref|), i.e. no worse than bf16 rounding already makes HF itself.
"""

from __future__ import annotations

import pytest
import torch
from tests.hf.hf_steps import random_sequences, run_scenario
from tests.reference import max_rel_error
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

from compile_attn import installed_backends
from compile_attn.hf import HFModelAdapter

_COMMON = dict(
    vocab_size=512,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
    initializer_range=0.05,
    tie_word_embeddings=False,
)


def _config(family: str):  # noqa: ANN202
    if family == "llama":
        return LlamaConfig(**_COMMON, head_dim=64)
    return Gemma2Config(
        **_COMMON,
        head_dim=128,
        query_pre_attn_scalar=96,
        sliding_window=8,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch_native", "triton", "flashinfer"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_bf16_logits_match_hf(family: str, backend: str) -> None:
    if backend not in installed_backends():
        pytest.skip(f"attention backend {backend!r} is not installed here (have: {installed_backends()})")
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(
        _config(family), attn_implementation="compile_attn", dtype=torch.float32
    )
    ref32 = AutoModelForCausalLM.from_config(
        _config(family), attn_implementation="eager", dtype=torch.float32
    )
    ref32.load_state_dict(ours.state_dict())
    ref16 = AutoModelForCausalLM.from_config(
        _config(family), attn_implementation="eager", dtype=torch.float32
    )
    ref16.load_state_dict(ours.state_dict())
    ours, ref32, ref16 = (m.to("cuda").eval() for m in (ours.bfloat16(), ref32, ref16.bfloat16()))

    adapter = HFModelAdapter(ours)
    kv = adapter.make_kv_cache(max_batch_size=8, max_context=128, kv_cache_tokens=1024)
    sequences = random_sequences(adapter.vocab_size, seed=7, device="cuda")
    logits = run_scenario(adapter, kv, backend, adapter.attention_layers(), sequences)
    with torch.no_grad():
        for i, (seq, got) in enumerate(zip(sequences, logits, strict=True)):
            want = ref32(seq[None]).logits[0]
            err_hf = max_rel_error(ref16(seq[None]).logits[0], want)
            err_ours = max_rel_error(got, want)
            print(f"{family} {backend} request {i}: err_ours {err_ours:.2e} err_hf_bf16 {err_hf:.2e}")
            assert err_ours <= 2 * err_hf + 5e-3, f"request {i}: {err_ours:.2e} vs HF bf16 {err_hf:.2e}"
