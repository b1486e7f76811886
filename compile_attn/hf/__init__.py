"""HuggingFace integration: ``attn_implementation="compile_attn"``, per-layer constants, model loading.

Importing this package needs transformers; it registers the attention function so HF models accept
``attn_implementation="compile_attn"``. See docs/hf.md.
"""

from compile_attn.hf.adapter import HFModelAdapter
from compile_attn.hf.attention import ATTN_IMPLEMENTATION, compile_attn_attention, compile_attn_mask
from compile_attn.hf.families import SUPPORTED_MODEL_TYPES, attention_layers, check_supported
from compile_attn.hf.loading import load_model
from compile_attn.hf.registration import is_registered, register

register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "SUPPORTED_MODEL_TYPES",
    "HFModelAdapter",
    "attention_layers",
    "check_supported",
    "compile_attn_attention",
    "compile_attn_mask",
    "is_registered",
    "load_model",
    "register",
]
