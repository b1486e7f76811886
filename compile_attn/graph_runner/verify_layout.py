"""Verify batches whose requests verify different numbers of drafts, in a full verify graph of Q tokens per request.

A verify graph lays out Q = ``GraphConfig.verify_tokens`` rows per request, and its attention lets row t of a request
see the first ``seq_len - Q + 1 + t`` keys. A request verifying n < Q tokens (fewer drafts: prompt lookup found a
shorter match, or none) takes the last n of its Q rows, with ``seq_len = prefix + n``: its real tokens then see exactly
their prefix, the drafts before them and themselves, as in an extend. The Q - n leading rows are filler: token id 0 at
position 0, writing the scratch slot, and they see a part of the prefix (at least one key where the route is taken:
``end_aligned_rows`` refuses a batch where a request's prefix is shorter than its filler). The graph's output rows of
the real tokens are gathered back into the batch's order (``outputs.gather_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence


def end_aligned_rows(prefix_lens: Sequence[int], extend_lens: Sequence[int], q: int) -> list[int] | None:
    """Each real token's row in the B x ``q`` layout (request b's n_b tokens in rows ``b*q + q - n_b ...``), or None
    where the layout cannot hold the batch: a request with no token or more than ``q``, or whose prefix is shorter
    than its filler rows (a filler row would see no key)."""
    rows: list[int] = []
    for b, (p, n) in enumerate(zip(prefix_lens, extend_lens)):
        if not 1 <= n <= q or p < q - n:
            return None
        start = b * q + q - n
        rows.extend(range(start, start + n))
    return rows
