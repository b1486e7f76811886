"""Per-layer constants read from HF configs, the drift guard, refusals, registration and misuse errors."""

from __future__ import annotations

import pytest
import torch
from tests.hf.hf_tiny_models import WINDOW, build_pair, tiny_config
from transformers import AutoModelForCausalLM, Gemma3Config, GPT2Config, LlamaConfig

import compile_attn.hf as hf
from compile_attn import (
    ForwardBatch,
    InvalidBatchError,
    UnsupportedConfigError,
    create_backend,
    forward_context,
)
from compile_attn.hf import HFModelAdapter, attention_layers

# Expected (scaling, sliding window per layer, softcap), written from the families' papers/configs,
# not from compile_attn: Gemma scales by query_pre_attn_scalar (24 in the tiny configs), not head_dim (16).
EXPECTED = {
    "llama": (16**-0.5, [None, None], 0.0),
    "qwen2": (16**-0.5, [None, WINDOW], 0.0),  # max_window_layers=1: layers from 1 on slide
    "qwen3": (16**-0.5, [None, None], 0.0),
    "mistral": (16**-0.5, [WINDOW, WINDOW], 0.0),
    "gemma2": (24**-0.5, [WINDOW, None], 2.0),  # sliding, full, ...
    "gemma3": (24**-0.5, [WINDOW, None], 0.0),
}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_attention_layer_constants(family: str) -> None:
    scaling, windows, softcap = EXPECTED[family]
    ours, _ = build_pair(family)
    for source in (ours, ours.config):
        layers = attention_layers(source)
        assert [layer.layer_id for layer in layers] == [0, 1]
        for layer, window in zip(layers, windows, strict=True):
            assert (layer.num_heads, layer.num_kv_heads, layer.head_dim) == (4, 2, 16)
            assert layer.scaling == pytest.approx(scaling, rel=1e-12)
            assert layer.sliding_window == window
            assert layer.logit_cap == softcap
            assert layer.causal


def test_drift_between_config_and_module_is_refused() -> None:
    ours, _ = build_pair("gemma2")
    ours.model.layers[1].self_attn.scaling = 16**-0.5  # as if transformers changed Gemma's scaling
    with pytest.raises(UnsupportedConfigError, match="layer 1.*scaling"):
        attention_layers(ours)


def test_context_layers_must_match_hf_call() -> None:
    """A backend built with other constants than the HF module passes is an error, not wrong logits."""
    ours, _ = build_pair("mistral")
    adapter = HFModelAdapter(ours)
    kv = adapter.make_kv_cache(max_batch_size=2, max_context=32, kv_cache_tokens=64)
    wrong = [
        layer.__class__(**{**layer.__dict__, "sliding_window": None}) for layer in adapter.attention_layers()
    ]
    backend = create_backend("torch_native", kv, wrong)
    row = kv.alloc_request()
    fb = ForwardBatch.build(
        req_pool_indices=[row],
        prefix_lens=[0],
        extend_lens=[5],
        out_cache_loc=kv.alloc_extend([row], [5]),
        input_ids=list(range(5)),
    )
    backend.init_forward_metadata(fb)
    with pytest.raises(UnsupportedConfigError, match="sliding_window"), forward_context(fb, backend):
        adapter(fb.input_ids, fb.positions)


def test_misuse_inside_context_is_an_error() -> None:
    ours, _ = build_pair("llama")
    adapter = HFModelAdapter(ours)
    kv = adapter.make_kv_cache(max_batch_size=2, max_context=32, kv_cache_tokens=64)
    backend = create_backend("torch_native", kv, adapter.attention_layers())
    row = kv.alloc_request()
    fb = ForwardBatch.build(
        req_pool_indices=[row],
        prefix_lens=[0],
        extend_lens=[6],
        out_cache_loc=kv.alloc_extend([row], [6]),
        input_ids=list(range(6)),
    )
    backend.init_forward_metadata(fb)
    with torch.no_grad():
        past = ours(input_ids=fb.input_ids[None, :3], use_cache=True).past_key_values  # stock HF, outside
    with forward_context(fb, backend), torch.no_grad():
        with pytest.raises(InvalidBatchError, match="batch size 2"):
            ours(input_ids=fb.input_ids.view(2, 3), position_ids=fb.positions.view(2, 3), use_cache=False)
        with pytest.raises(InvalidBatchError, match="use_cache=False"):
            ours(input_ids=fb.input_ids[None], position_ids=fb.positions[None], past_key_values=past)
        with pytest.raises(InvalidBatchError, match="the batch's own input_ids"):
            adapter(fb.input_ids[:4], fb.positions[:4])


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        (GPT2Config(n_layer=1, n_embd=32, n_head=2), "'gpt2'"),
        (Gemma3Config(text_config=tiny_config("gemma3").to_dict()), "Gemma3ForCausalLM"),
        (
            LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, is_causal=False),
            "non-causal",
        ),
    ],
)
def test_unsupported_families_are_refused(config, needle: str) -> None:  # noqa: ANN001
    with pytest.raises(UnsupportedConfigError, match="Supported families") as info:
        hf.load_model(config)
    assert needle in str(info.value)


def test_registration_is_idempotent_and_switchable() -> None:
    hf.register()
    hf.register()
    assert hf.is_registered()
    config = tiny_config("qwen3")
    model = AutoModelForCausalLM.from_config(config)  # stock attention
    assert model.config._attn_implementation != "compile_attn"
    adapter = HFModelAdapter(model)  # switches it
    assert model.config._attn_implementation == "compile_attn"
    model.set_attn_implementation("sdpa")
    model.set_attn_implementation("compile_attn")
    assert adapter.model.config._attn_implementation == "compile_attn"
