"""Counter-based random numbers for sampling: a hash of (request seed, position, token id), so a seeded
request draws the same noise for a token whatever else is in its batch and whichever sampling path runs.

The per-element hash works in int32 with wrap-around multiplication and masked shifts, the same bits as
the 32-bit hash in unsigned arithmetic; elementwise and cheap, so Inductor fuses it into the kernel that
reads the logits. Nothing here draws from a torch generator.
"""

from __future__ import annotations

import torch

_MIX = 0x045D9F3B
_SEED_MUL, _POS_MUL, _TOKEN_MUL = 0x2545F491, 0x6C8E9CF5, 0x1B873593


def _mix32_int32(h: torch.Tensor) -> torch.Tensor:
    """The same mix on int32 bit patterns: multiplication wraps modulo 2**32, and ``(h >> 16) & 0xFFFF`` is the
    logical shift that int32's arithmetic ``>>`` is not."""
    h = (h ^ ((h >> 16) & 0xFFFF)) * _MIX
    h = (h ^ ((h >> 16) & 0xFFFF)) * _MIX
    return h ^ ((h >> 16) & 0xFFFF)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int32 ``[N, 1]`` key per row from int64 ``seeds[N]`` and ``positions[N]``: their low 32 bits, hashed.
    All int32, so that recomputing it per element (where Inductor inlines it) stays cheap."""
    h = seeds.to(torch.int32) * _SEED_MUL + positions.to(torch.int32) * _POS_MUL
    return _mix32_int32(h)[:, None]


def hashed_uniform_from_keys(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1) for row ``keys[N, 1]`` (see ``row_keys``) and ``token_ids`` (``[V]`` or
    ``[N, K]``, any integer dtype): 24 hashed bits, centred in their interval so 0 and 1 never occur."""
    h = _mix32_int32(keys + token_ids.to(torch.int32) * _TOKEN_MUL)
    return (((h >> 8) & 0xFFFFFF).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def hashed_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[N, V]`` uniforms in (0, 1) from int64 ``seeds[N]`` and ``positions[N]``; deterministic per row."""
    ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int32)
    return hashed_uniform_from_keys(row_keys(seeds, positions), ids)


def hashed_gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise ``-log(E)`` with ``E = -log1p(-u) ~ Exp(1)``: ``argmax(logits / T + noise)`` draws from
    ``softmax(logits / T)``. ``log1p`` keeps E accurate (never 0) for u near 0 and near 1."""
    u = hashed_uniform_from_keys(keys, token_ids)
    return -torch.log(-torch.log1p(-u))
