"""Independent float64 attention reference over KV gathered position by position from the pool.

Written without any compile_attn attention code: it walks each request's positions through
``req_to_token``, builds the mask from absolute positions, maps query heads to KV heads explicitly,
and computes softmax attention in float64.
"""

from __future__ import annotations

import math

import torch


def reference_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
    *,
    scaling: float,
    sliding_window: int | None = None,
    logit_cap: float = 0.0,
    causal: bool = True,
) -> torch.Tensor:
    """Attention output ``[T, Hq, Dv]`` in float64 for tokens laid out request after request.

    Prefix K/V are read from ``k_pool``/``v_pool`` through ``req_to_token``; the new tokens' K/V
    come from ``k_new``/``v_new`` (what the step writes).
    """
    num_q_heads, num_kv_heads = q.shape[1], k_new.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(q.shape[0], num_q_heads, v_new.shape[2], dtype=torch.float64)
    t0 = 0
    for row, prefix, ext in zip(req_rows, prefix_lens, extend_lens):
        slots = [int(req_to_token[row, j]) for j in range(prefix)]
        keys = torch.cat([k_pool[slots].double().cpu(), k_new[t0 : t0 + ext].double().cpu()])  # [L, Hkv, D]
        vals = torch.cat([v_pool[slots].double().cpu(), v_new[t0 : t0 + ext].double().cpu()])
        length = prefix + ext
        for i in range(ext):
            qpos = prefix + i
            visible = torch.tensor(
                [
                    (not causal or j <= qpos) and (sliding_window is None or j > qpos - sliding_window)
                    for j in range(length)
                ]
            )
            for h in range(num_q_heads):
                kvh = h // group
                s = keys[:, kvh, :] @ q[t0 + i, h].double().cpu() * scaling
                if logit_cap > 0:
                    s = logit_cap * torch.tanh(s / logit_cap)
                s = s.masked_fill(~visible, -math.inf)
                p = torch.softmax(s, dim=0)
                out[t0 + i, h] = p @ vals[:, kvh, :]
        t0 += ext
    return out


def max_rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (0 when both are empty)."""
    if expected.numel() == 0:
        return 0.0
    scale = expected.abs().max().clamp(min=1e-12)
    return float((actual.double().cpu() - expected.double().cpu()).abs().max() / scale)
