"""Tiny random-init configs of every supported HF family (2 layers, fp32) and helpers to build models.

Windows are short (8 tokens) so test prompts are longer than the window; Gemma's
``query_pre_attn_scalar`` differs from ``head_dim`` and its softcap is small, so a wrong scaling or a
missing softcap changes the logits. A larger ``initializer_range`` keeps attention scores non-trivial.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

import compile_attn.hf  # noqa: F401  (registers attn_implementation="compile_attn")

WINDOW = 8
_COMMON: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,
    tie_word_embeddings=False,
)


def tiny_config(family: str, **overrides: Any) -> PretrainedConfig:
    """The tiny config of ``family``; ``overrides`` replace its fields (e.g. ``num_key_value_heads=1``)."""
    config = _tiny_config(family)
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


def _tiny_config(family: str) -> PretrainedConfig:
    if family == "llama":
        return LlamaConfig(**_COMMON)
    if family == "qwen2":  # layer 0 full, layer 1 sliding
        return Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if family == "qwen3":
        return Qwen3Config(**_COMMON, head_dim=16)
    if family == "mistral":  # every layer sliding
        return MistralConfig(**_COMMON, head_dim=16, sliding_window=WINDOW)
    if family == "gemma2":  # alternating sliding/full, softcap, query_pre_attn_scalar != head_dim
        return Gemma2Config(
            **_COMMON,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=30.0,
        )
    if family == "gemma3":
        return Gemma3TextConfig(
            **_COMMON,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        )
    raise ValueError(f"unknown test family {family!r}")


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")


def build_pair(
    family: str, attn: str = "eager", seed: int = 0, **overrides: Any
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(model with attn_implementation="compile_attn", reference with ``attn``): same weights, eval, fp32.

    ``attn="stock"`` leaves the reference at HF's default attention implementation; ``overrides`` go to
    ``tiny_config``.
    """
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    ours = AutoModelForCausalLM.from_config(
        config, attn_implementation="compile_attn", dtype=torch.float32
    ).eval()
    ref_kwargs = {} if attn == "stock" else {"attn_implementation": attn}
    ref = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32, **ref_kwargs).eval()
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def hf_greedy(stock: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """HF ``generate``'s ``n`` greedy tokens after ``prompt`` (no EOS): the reference the engine tests compare with."""
    ids = torch.tensor([prompt])
    out = stock.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
