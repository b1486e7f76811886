"""AttentionLayer: the per-layer constants attention needs (heads, head dims, scale, window, softcap).

Built once per model layer (by the HF integration or by hand) and looked up by ``layer_id`` in the
forward context; never rebuilt per call. Holds no tensors.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from compile_attn.arg_checks import finite_float, non_negative_int, positive_int
from compile_attn.errors import InvalidConfigError


@dataclass(frozen=True)
class AttentionLayer:
    """Constants of one attention layer.

    ``sliding_window`` follows HF semantics: a query at position p sees key positions j with
    ``p - sliding_window < j <= p``; ``None`` means full attention. ``logit_cap`` > 0 applies
    ``cap * tanh(score / cap)`` to the scaled scores (Gemma2 softcap); 0 disables it. Bad values (NaN or
    non-positive ``scaling``, NaN or negative ``logit_cap``, non-positive sizes, ``num_heads`` not a multiple
    of ``num_kv_heads``) raise InvalidConfigError, a ValueError.
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
        owner = f"AttentionLayer(layer_id={self.layer_id!r})"
        checked = {"layer_id": non_negative_int(owner, "layer_id", self.layer_id)}
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            checked[name] = positive_int(owner, name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise InvalidConfigError(
                f"{owner}: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) "
                f"for grouped-query attention; take both from the model config"
            )
        checked["v_head_dim"] = (
            self.head_dim if self.v_head_dim is None else positive_int(owner, "v_head_dim", self.v_head_dim)
        )
        checked["scaling"] = (
            1.0 / math.sqrt(self.head_dim) if self.scaling is None else finite_float(
                owner, "scaling", self.scaling, positive=True, hint="leave it None for 1/sqrt(head_dim)")
        )
        if self.sliding_window is not None:
            if not isinstance(self.sliding_window, numbers.Integral) or isinstance(self.sliding_window, bool) or (
                    self.sliding_window <= 0):
                raise InvalidConfigError(
                    f"{owner}: sliding_window must be a positive token count or None (full attention), "
                    f"got {self.sliding_window!r}"
                )
            checked["sliding_window"] = int(self.sliding_window)
        checked["logit_cap"] = finite_float(owner, "logit_cap", self.logit_cap, positive=False,
                                            hint="0 disables softcap")
        if not isinstance(self.causal, bool):
            raise InvalidConfigError(f"{owner}: causal must be True or False, got {self.causal!r}")
        for name, value in checked.items():  # plain Python numbers (e.g. not numpy ints), as validated
            object.__setattr__(self, name, value)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for MHA, >1 for GQA)."""
        return self.num_heads // self.num_kv_heads
