"""Register ``attn_implementation="compile_attn"`` with transformers (attention and mask interfaces).

``register()`` is idempotent and cheap; ``import compile_attn`` calls it when transformers is
installed, so ``from_pretrained(..., attn_implementation="compile_attn")`` works without further setup.
"""

from __future__ import annotations

from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from compile_attn.hf.attention import ATTN_IMPLEMENTATION, compile_attn_attention, compile_attn_mask


def register() -> None:
    """Make ``"compile_attn"`` a valid ``attn_implementation`` for every transformers model."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, compile_attn_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, compile_attn_mask)


def is_registered() -> bool:
    return (
        AttentionInterface._global_mapping.get(ATTN_IMPLEMENTATION) is compile_attn_attention
        and AttentionMaskInterface._global_mapping.get(ATTN_IMPLEMENTATION) is compile_attn_mask
    )
