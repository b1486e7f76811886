"""AttentionLayer: the per-layer constants attention needs (heads, head dims, scale, window, softcap).

Built once per model layer (by the HF integration or by hand) and looked up by ``layer_id`` in the
forward context; never rebuilt per call. Holds no tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionLayer:
    """Constants of one attention layer.

    ``sliding_window`` follows HF semantics: a query at position p sees key positions j with
    ``p - sliding_window < j <= p``; ``None`` means full attention. ``logit_cap`` > 0 applies
    ``cap * tanh(score / cap)`` to the scaled scores (Gemma2 softcap); 0 disables it.
    """

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    scaling: float | None = None
    sliding_window: int | None = None
    logit_cap: float = 0.0
    causal: bool = True

    def __post_init__(self) -> None:
        if self.layer_id < 0:
            raise ValueError(f"layer_id must be >= 0, got {self.layer_id}")
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"AttentionLayer.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) for GQA"
            )
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if self.scaling is None:
            object.__setattr__(self, "scaling", 1.0 / math.sqrt(self.head_dim))
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(
                f"sliding_window must be a positive token count or None (full attention), got {self.sliding_window}"
            )
        if self.logit_cap < 0:
            raise ValueError(f"logit_cap must be >= 0 (0 disables softcap), got {self.logit_cap}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for MHA, >1 for GQA)."""
        return self.num_heads // self.num_kv_heads
