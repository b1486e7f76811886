"""Batched token sampling on the device: greedy, temperature, top-k, top-p, per-request seeds, no host sync.

Randomness comes from a counter-based hash of (request seed, position, vocab index), so a seeded
request samples the same tokens whatever else is in its batch. Sampling is an exponential race
(argmax of p / E with E ~ Exp(1)), equivalent to drawing from p.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(h: torch.Tensor) -> torch.Tensor:
    h = ((h ^ (h >> 16)) * 0x045D9F3B) & _MASK32
    h = ((h ^ (h >> 16)) * 0x045D9F3B) & _MASK32
    return h ^ (h >> 16)


def hashed_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[N, V]`` uniforms in (0, 1) from int64 ``seeds[N]`` and ``positions[N]``; deterministic per row."""
    idx = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = (seeds[:, None] & _MASK32) * 0x2545F491 + (positions[:, None] & _MASK32) * 0x6C8E9CF5
    h = _mix32(h & _MASK32)
    h = _mix32((h + idx[None, :] * 0x1B873593) & _MASK32)
    return ((h >> 8).to(torch.float32) + 0.5) / float(1 << 24)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Next token per row of ``logits[N, V]``. Rows with temperature 0 are greedy. top_k 0 and top_p 1
    disable those filters. All per-row parameters are device tensors of length N."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    probs = (logits / temperature.clamp(min=1e-5)[:, None]).softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    keep_sorted = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    keep_sorted &= (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p[:, None]  # the top token always stays
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    noise = -torch.log(hashed_uniform(seeds, positions, logits.shape[-1]))
    sampled = (probs.masked_fill(~keep, 0.0) / noise).argmax(dim=-1)
    return torch.where(temperature <= 0, greedy, sampled)
