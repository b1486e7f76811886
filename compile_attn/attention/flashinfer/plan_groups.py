"""Group layers by what FlashInfer bakes into a plan, so each step plans once per group.

FlashInfer's ``plan()`` fixes the head counts, head dim, sliding window, logit softcap, softmax scale
and causality; ``run()`` cannot override them. Layers that agree on all of these share one set of
wrappers. A typical model has one group; Gemma2/3 have two (sliding-window and full layers).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from compile_attn.layer import AttentionLayer


@dataclass(frozen=True)
class PlanGroup:
    """Plan parameters shared by the layers of one group (``window_left = sliding_window - 1``, -1 = full)."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    window_left: int
    logits_soft_cap: float
    sm_scale: float
    causal: bool

    @classmethod
    def of(cls, layer: AttentionLayer) -> PlanGroup:
        # HF window W: a query at p sees p - W < j <= p; FlashInfer's window_left w: p - w <= j <= p.
        window_left = layer.sliding_window - 1 if layer.sliding_window is not None else -1
        return cls(
            num_qo_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            window_left=window_left,
            logits_soft_cap=float(layer.logit_cap),
            sm_scale=float(layer.scaling),
            causal=layer.causal,
        )

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def uses_window(self) -> bool:
        return self.window_left >= 0

    @property
    def uses_softcap(self) -> bool:
        return self.logits_soft_cap > 0

    def describe(self) -> str:
        window = f"window {self.window_left + 1}" if self.uses_window else "full"
        cap = f", softcap {self.logits_soft_cap:g}" if self.uses_softcap else ""
        return f"{self.num_qo_heads}q/{self.num_kv_heads}kv x {self.head_dim}, {window}{cap}"


def group_layers(layers: Iterable[AttentionLayer]) -> tuple[list[PlanGroup], dict[int, int]]:
    """``(groups, layer_id -> group index)``; groups in order of first appearance."""
    groups: list[PlanGroup] = []
    index: dict[PlanGroup, int] = {}
    layer_group: dict[int, int] = {}
    for layer in sorted(layers, key=lambda item: item.layer_id):
        group = PlanGroup.of(layer)
        if group not in index:
            index[group] = len(groups)
            groups.append(group)
        layer_group[layer.layer_id] = index[group]
    return groups, layer_group


def use_tensor_cores(group: PlanGroup, kv_dtype: torch.dtype, override: bool | None) -> bool:
    """Decode on tensor cores for large GQA groups or an fp8 KV cache, unless ``override`` says otherwise."""
    if override is not None:
        return override
    return group.group_size >= 4 or kv_dtype.itemsize == 1
