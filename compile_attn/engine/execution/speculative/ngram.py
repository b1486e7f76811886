"""Prompt-lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of a request's last
tokens.

For each n from ``prompt_lookup_max`` down to ``prompt_lookup_min`` the request's last n tokens are looked for earlier
in its own tokens (prompt and output); the longest n that occurs wins, among its occurrences the latest, and the
proposal is the (up to) K tokens that followed it. Host work on the request's token array only, vectorised with
NumPy: candidates are the positions holding the last token, narrowed one position further back per n.
``propose_tree`` merges the continuations of several matches into a tree (speculative_config's ``topk`` > 1).
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
        if limit <= 0:
            return []
        arr = _as_array(token_ids)
        ends = self._match_ends(arr, 1)
        return arr[ends[0] + 1 : ends[0] + 1 + limit].tolist() if ends else []

    def propose_tree(self, token_ids: array.array | list[int], max_depth: int, topk: int,
                     max_nodes: int) -> tuple[list[int], list[int]]:
        """A draft tree: the continuations (up to ``max_depth`` tokens) of up to ``topk`` matches, merged where they
        agree (a trie), at most ``max_nodes`` nodes. Matches are taken longest n-gram first, then latest first.
        Returns (tokens, parents), ``parents[i]`` the index of node i's parent among the tokens (-1: the root)."""
        depth = min(self.k, max_depth)
        if depth <= 0 or max_nodes <= 0:
            return [], []
        arr = _as_array(token_ids)
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[int, dict[int, int]] = {}
        for end in self._match_ends(arr, topk):
            node = -1
            for tok in arr[end + 1 : end + 1 + depth].tolist():
                child = children.setdefault(node, {}).get(tok)
                if child is None:
                    if len(tokens) == max_nodes:
                        return tokens, parents
                    child = children[node][tok] = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                node = child
        return tokens, parents

    def _match_ends(self, arr: np.ndarray, limit: int) -> list[int]:
        """Up to ``limit`` positions ``i`` (before the last) where an n-gram ending at ``i`` equals the last n tokens,
        ``prompt_lookup_min <= n <= prompt_lookup_max``: the longest n first, the latest first within one n."""
        length = len(arr)
        if length <= self.min_n:
            return []
        alive = np.flatnonzero(arr[: length - 1] == arr[length - 1])  # occurrences of the last token, before it
        by_n: list[np.ndarray] = []
        for n in range(1, min(self.max_n, length - 1) + 1):
            if n > 1:
                alive = alive[alive >= n - 1]
                alive = alive[arr[alive - (n - 1)] == arr[length - n]]
            if alive.size == 0:
                break
            if n >= self.min_n:
                by_n.append(alive)
        out: list[int] = []
        for ends in reversed(by_n):  # the longest n first
            for end in ends[::-1].tolist():
                if end not in out:
                    out.append(end)
                    if len(out) == limit:
                        return out
        return out


def _as_array(token_ids: array.array | list[int]) -> np.ndarray:
    if isinstance(token_ids, array.array):
        return np.frombuffer(token_ids, dtype=np.int64)
    return np.asarray(token_ids, dtype=np.int64)
