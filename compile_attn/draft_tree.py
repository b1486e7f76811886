"""Draft trees of speculative verification (``ForwardMode.TARGET_VERIFY``): which new tokens see which.

Request b of a verify step adds its last accepted token (the root, new token 0) and its draft tokens;
``parents[i]`` is the index, among the request's new tokens, of token i's parent: -1 for the root, else an
earlier token. Token i attends to the request's cached positions, its ancestors and itself; its rotary position
is ``prefix + depth(i)``. A chain ``(-1, 0, 1, ...)`` is an ordinary causal extend. This module checks parent
lists and turns them into positions and masks on the host; it imports nothing of compile_attn but its errors.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import numpy as np
import torch

from compile_attn.errors import InvalidBatchError

Parents = tuple[int, ...]


def chain(n: int) -> Parents:
    """The parents of a chain of ``n`` tokens: ``(-1, 0, 1, ..., n - 2)``."""
    return tuple(range(-1, n - 1))


def is_chain(parents: Sequence[int]) -> bool:
    """Whether every token's parent is the token before it (a causal extend)."""
    return all(p == i - 1 for i, p in enumerate(parents))


def has_tree(draft_parents: Sequence[Sequence[int]] | None) -> bool:
    """Whether some request's parents are not a chain (None: every request is a chain)."""
    return draft_parents is not None and not all(is_chain(p) for p in draft_parents)


def check_draft_parents(draft_parents: Sequence[Sequence[int]], extend_lens: Sequence[int], *,
                        verify: bool = True) -> tuple[Parents, ...]:
    """``draft_parents`` as tuples of ints, or InvalidBatchError naming the request and the bad value: one entry
    per request, ``extend_lens[b]`` parents each, -1 for token 0 and ``0 <= parents[i] < i`` for the others.
    ``verify``: whether the batch's forward mode is TARGET_VERIFY (draft trees belong to no other step)."""
    if not verify:
        raise InvalidBatchError(
            "draft_parents describe a verification step's draft trees; build the batch with "
            "forward_mode=ForwardMode.TARGET_VERIFY (or leave draft_parents None)"
        )
    try:
        out = tuple(tuple(operator.index(p) for p in parents) for parents in draft_parents)
    except TypeError:
        raise InvalidBatchError(
            f"draft_parents must be one sequence of int parent indices per request, got {draft_parents!r}"
        ) from None
    if len(out) != len(extend_lens):
        raise InvalidBatchError(
            f"draft_parents has {len(out)} entries but the batch has {len(extend_lens)} requests; give one tuple "
            f"of parent indices per request (a chain of n tokens is (-1, 0, ..., n - 2))"
        )
    for b, (parents, n) in enumerate(zip(out, extend_lens)):
        if len(parents) != n:
            raise InvalidBatchError(
                f"draft_parents of request {b} has {len(parents)} parents but its extend_len is {n}; give one "
                f"parent index per new token"
            )
        if parents and parents[0] != -1:
            raise InvalidBatchError(
                f"draft_parents of request {b}: token 0 is the root (the last accepted token), its parent must be "
                f"-1, got {parents[0]}"
            )
        for i, p in enumerate(parents[1:], start=1):
            if not 0 <= p < i:
                raise InvalidBatchError(
                    f"draft_parents of request {b}: token {i} has parent {p}; a parent must be an earlier token of "
                    f"the same request (0 <= parent < {i})"
                )
    return out


def depths(parents: Sequence[int]) -> list[int]:
    """Each token's distance from the root (the root has depth 0)."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def tree_positions(prefix_lens: Sequence[int], parents: Sequence[Sequence[int]]) -> list[int]:
    """The rotary position of every new token, request after request: ``prefix_lens[b] + depth(i)``."""
    return [prefix + d for prefix, request in zip(prefix_lens, parents) for d in depths(request)]


def _ancestors(parents: Sequence[int]) -> np.ndarray:
    """``[n, n]`` bool: ``out[i, j]`` when j is i or one of its ancestors."""
    n = len(parents)
    out = np.zeros((n, n), dtype=np.bool_)
    for i, p in enumerate(parents):
        if p >= 0:
            out[i, :i] = out[p, :i]
        out[i, i] = True
    return out


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """``[n, n]`` bool tensor: ``mask[i, j]`` when new token i may attend to new token j (j is i or an ancestor)."""
    return torch.from_numpy(_ancestors(parents))


def ancestor_masks(parents: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Every request's ``ancestor_mask`` flattened row-major and concatenated (uint8), and the ``[B + 1]`` int64
    offsets of each request's ``[n, n]`` block: the mask over new keys only, as the triton kernel takes it."""
    blocks = [_ancestors(p).reshape(-1) for p in parents]
    offsets = np.zeros(len(blocks) + 1, dtype=np.int64)
    np.cumsum([b.size for b in blocks], out=offsets[1:])
    flat = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.bool_)
    return flat.view(np.uint8), offsets


@functools.lru_cache(maxsize=1024)
def ancestor_bits(parents: Parents) -> tuple[int, ...]:
    """Token i's ancestors and itself as the bits of one int64 word (bit j: token j; at most 64 tokens), two's
    complement for bit 63: the rows of ``ancestor_mask`` as the triton decode kernel's verify mode takes them. Cached
    per tree (a speculative config's trees repeat their shapes)."""
    if len(parents) > 64:
        raise ValueError(f"ancestor_bits packs at most 64 tokens into an int64 word, got a tree of {len(parents)}")
    words: list[int] = []
    for i, p in enumerate(parents):
        words.append((words[p] if p >= 0 else 0) | (1 << i))
    return tuple(w - (1 << 64) if w >= 1 << 63 else w for w in words)


def verify_mask(prefix_lens: Sequence[int], parents: Sequence[Sequence[int]], window: int | None = None) -> np.ndarray:
    """Every request's full ``[n, prefix + n]`` mask (cached keys, then new keys) flattened row-major and
    concatenated (bool), with an HF sliding ``window`` applied on rotary positions (``prefix + depth``): the
    layout FlashInfer's ``custom_mask`` takes."""
    blocks = []
    for prefix, request in zip(prefix_lens, parents):
        n = len(request)
        mask = np.ones((n, prefix + n), dtype=np.bool_)
        mask[:, prefix:] = _ancestors(request)
        if window is not None:
            q_pos = prefix + np.asarray(depths(request), dtype=np.int64)
            k_pos = np.concatenate([np.arange(prefix, dtype=np.int64), q_pos])
            mask &= k_pos[None, :] > q_pos[:, None] - window
        blocks.append(mask.reshape(-1))
    return np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.bool_)
