"""Which HuggingFace model families compile_attn can serve, and their per-layer attention constants.

Reads a transformers config into one ``AttentionLayer`` per decoder layer (heads, head_dim, scaling,
sliding window per layer type, softcap) and, given a model, checks those constants against what each
HF attention module actually uses, so the two cannot drift. Families we cannot serve are refused
with an error naming the missing feature and the supported list; this module never runs a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from compile_attn.errors import UnsupportedConfigError
from compile_attn.layer import AttentionLayer

if TYPE_CHECKING:
    from torch import nn

# model_type -> human name. Gemma3 is the text-only Gemma3ForCausalLM ("gemma3_text").
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mistral": "Mistral",
    "gemma2": "Gemma2",
    "gemma3_text": "Gemma3 (text-only, Gemma3ForCausalLM)",
}

# model_type -> what its attention needs that compile_attn does not implement (for the error message).
_KNOWN_MISSING: dict[str, str] = {
    "deepseek_v2": "multi-head latent attention (MLA)",
    "deepseek_v3": "multi-head latent attention (MLA)",
    "bloom": "ALiBi position biases",
    "mpt": "ALiBi position biases",
    "falcon": "ALiBi / parallel attention variants",
    "t5": "encoder-decoder cross-attention",
    "bart": "encoder-decoder cross-attention",
    "whisper": "encoder-decoder cross-attention",
    "bert": "non-causal (bidirectional) attention",
    "roberta": "non-causal (bidirectional) attention",
    "gemma3": "the multimodal Gemma3ForConditionalGeneration (vision tower, bidirectional attention over "
    "image tokens); load a text-only Gemma3ForCausalLM checkpoint (model_type 'gemma3_text') instead",
    "llama4": "chunked local attention and a vision tower",
    "gpt_oss": "attention sinks",
    "qwen3_next": "linear-attention (gated DeltaNet) layers",
    "mllama": "cross-attention to image features",
}

_LAYER_TYPES = ("full_attention", "sliding_attention")
_GEMMA_TYPES = ("gemma2", "gemma3_text")


def supported_list() -> str:
    return ", ".join(f"{name} ({mt!r})" for mt, name in SUPPORTED_MODEL_TYPES.items())


def _unsupported(config: Any, missing: str) -> UnsupportedConfigError:
    mt = getattr(config, "model_type", None)
    return UnsupportedConfigError(
        f"model_type {mt!r} is not supported by compile_attn's HF integration: it needs {missing}, which "
        f"compile_attn does not implement. Supported families: {supported_list()}"
    )


def check_supported(config: Any) -> None:
    """Raise UnsupportedConfigError unless ``config`` is a causal decoder of a supported family."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise _unsupported(config, _KNOWN_MISSING.get(mt, "an attention variant that has not been validated"))
    if getattr(config, "is_encoder_decoder", False):
        raise _unsupported(config, "encoder-decoder cross-attention")
    if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
        raise _unsupported(
            config, "non-causal (bidirectional) attention (config.use_bidirectional_attention)"
        )
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        unknown = sorted({t for t in layer_types if t not in _LAYER_TYPES})
        if unknown:
            raise _unsupported(
                config, f"attention layer types {unknown} (only {list(_LAYER_TYPES)} are implemented)"
            )
        if len(layer_types) != config.num_hidden_layers:
            raise UnsupportedConfigError(
                f"config.layer_types has {len(layer_types)} entries but num_hidden_layers is "
                f"{config.num_hidden_layers}; fix the config so there is one layer type per layer"
            )


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _scaling(config: Any) -> float:
    if config.model_type in _GEMMA_TYPES:  # Gemma scales by query_pre_attn_scalar, not head_dim
        return float(config.query_pre_attn_scalar) ** -0.5
    return float(_head_dim(config)) ** -0.5


def _sliding_window(config: Any, layer_idx: int) -> int | None:
    """Window of layer ``layer_idx`` in HF semantics (sees keys j with p - window < j <= p), None = full."""
    window = getattr(config, "sliding_window", None)
    if config.model_type == "llama":
        return None
    if config.model_type == "mistral":  # one window for every layer (HF masks with config.sliding_window)
        return window
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or layer_types[layer_idx] != "sliding_attention":
        return None
    if window is None:
        raise UnsupportedConfigError(
            f"layer {layer_idx} is a 'sliding_attention' layer but config.sliding_window is None; "
            f"set a window or mark the layer 'full_attention'"
        )
    return int(window)


def layers_from_config(config: Any) -> list[AttentionLayer]:
    """One AttentionLayer per decoder layer, from the (text) config alone."""
    check_supported(config)
    softcap = getattr(config, "attn_logit_softcapping", None) or 0.0
    return [
        AttentionLayer(
            layer_id=i,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=_head_dim(config),
            scaling=_scaling(config),
            sliding_window=_sliding_window(config, i),
            logit_cap=float(softcap),
            causal=True,
        )
        for i in range(config.num_hidden_layers)
    ]


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """The HF self-attention modules of ``model`` by ``layer_idx`` (modules with q/k/v projections)."""
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        if all(hasattr(module, a) for a in ("layer_idx", "q_proj", "k_proj", "v_proj", "head_dim")):
            if module.layer_idx in found:
                raise UnsupportedConfigError(
                    f"two attention modules claim layer_idx {module.layer_idx} (second: {name}); "
                    f"compile_attn needs one self-attention module per layer"
                )
            found[module.layer_idx] = module
    return found


def _module_value(module: nn.Module, config: Any, attr: str) -> Any:
    """What the HF module passes to the attention function for ``attr`` (see the families' modeling code)."""
    if attr == "sliding_window" and config.model_type == "mistral":
        return getattr(config, "sliding_window", None)  # Mistral passes the config value to every layer
    if attr == "sliding_window" and config.model_type == "llama":
        return None
    if attr == "softcap":
        return getattr(module, "attn_logit_softcapping", None) or 0.0
    return getattr(module, attr)


def check_against_modules(model: nn.Module, layers: list[AttentionLayer], config: Any) -> None:
    """Raise if any HF attention module uses constants different from ``layers`` (drift guard)."""
    modules = attention_modules(model)
    if sorted(modules) != [layer.layer_id for layer in layers]:
        raise UnsupportedConfigError(
            f"the model has attention modules for layers {sorted(modules)} but its config describes "
            f"{len(layers)} layers; compile_attn cannot map them one to one"
        )
    for layer in layers:
        module = modules[layer.layer_id]
        actual = {
            "num_heads": module.q_proj.out_features // module.head_dim,
            "num_kv_heads": module.k_proj.out_features // module.head_dim,
            "head_dim": module.head_dim,
            "scaling": float(_module_value(module, config, "scaling")),
            "sliding_window": _module_value(module, config, "sliding_window"),
            "logit_cap": float(_module_value(module, config, "softcap")),
            "causal": bool(getattr(module, "is_causal", True)),
        }
        for field, value in actual.items():
            expected = getattr(layer, field)
            same = abs(value - expected) <= 1e-12 * abs(expected) if field == "scaling" else value == expected
            if not same:
                raise UnsupportedConfigError(
                    f"layer {layer.layer_id} ({type(module).__name__}): the HF module uses "
                    f"{field}={value!r} but compile_attn derived {field}={expected!r} from the config; "
                    f"this transformers version changed how {config.model_type} computes it. Please report it"
                )


def attention_layers(model_or_config: Any) -> list[AttentionLayer]:
    """Per-layer attention constants of an HF causal LM (or its config), one AttentionLayer per layer.

    Given a model, the constants are also checked against each HF attention module.
    """
    config = getattr(model_or_config, "config", model_or_config)
    layers = layers_from_config(config)
    if hasattr(model_or_config, "named_modules"):
        check_against_modules(model_or_config, layers, config)
    return layers
