"""Prompt-lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of a request's last
tokens.

For each n from ``prompt_lookup_max`` down to ``prompt_lookup_min`` the request's last n tokens are looked for earlier
in its own tokens (prompt and output); the longest n that occurs wins, among its occurrences the latest, and the
proposal is the (up to) K tokens that followed it. Host work on the request's token array only, vectorised with
NumPy: candidates are the positions holding the last token, narrowed one position further back per n.
"""

from __future__ import annotations

import array

import numpy as np


class NgramProposer:
    """Proposes up to ``num_speculative_tokens`` drafts per request by prompt lookup."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: array.array | list[int], max_tokens: int | None = None) -> list[int]:
        """Drafts to follow ``token_ids`` (prompt and known outputs, no placeholder): at most ``max_tokens`` (default
        K) tokens, empty when no n-gram of the allowed lengths occurs earlier."""
        limit = self.k if max_tokens is None else min(self.k, max_tokens)
        length = len(token_ids)
        if limit <= 0 or length <= self.min_n:
            return []
        arr = np.frombuffer(token_ids, dtype=np.int64) if isinstance(token_ids, array.array) else np.asarray(
            token_ids, dtype=np.int64)
        alive = np.flatnonzero(arr[: length - 1] == arr[length - 1])  # occurrences of the last token, before it
        best = -1
        for n in range(1, min(self.max_n, length - 1) + 1):
            if n > 1:
                alive = alive[alive >= n - 1]
                alive = alive[arr[alive - (n - 1)] == arr[length - n]]
            if alive.size == 0:
                break
            if n >= self.min_n:
                best = int(alive[-1])  # the latest occurrence of the longest n-gram so far
        if best < 0:
            return []
        return arr[best + 1 : best + 1 + limit].tolist()
