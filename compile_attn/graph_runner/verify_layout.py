"""Verify batches whose requests verify different numbers of drafts, in a full verify graph of Q tokens per request.

A verify graph lays out Q = ``GraphConfig.verify_tokens`` rows per request, and its attention lets row t of a request
see the first ``seq_len - Q + 1 + t`` keys. A request verifying n < Q tokens (fewer drafts: prompt lookup found a
shorter match, or none) takes the last n of its Q rows, with ``seq_len = prefix + n``: its real tokens then see exactly
their prefix, the drafts before them and themselves, as in an extend. The Q - n leading rows are filler: token id 0 at
position 0, writing the scratch slot, and they see a part of the prefix (at least one key where the route is taken:
``end_aligned_rows`` refuses a batch where a request's prefix is shorter than its filler). The graph's output rows of
the real tokens are gathered back into the batch's order (``outputs.gather_rows``).

Tree verify graphs (``GraphConfig.verify_trees``) give every view draft parents (``view_parents``): the batch's trees,
chains of Q for its chain requests and padded requests. An end-aligned chain request's rows then see the first
``t + 1`` of the last Q keys, as in a chain graph: its filler rows' keys are prefix keys.
"""

from __future__ import annotations

from collections.abc import Sequence

from compile_attn.draft_tree import chain


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


def view_parents(draft_parents: Sequence[tuple[int, ...]] | None, bucket: int, q: int) -> tuple[tuple[int, ...], ...]:
    """The draft parents of a tree verify graph's view of ``bucket`` requests x ``q`` rows: ``draft_parents`` (a tree
    batch's, each of ``q`` tokens) or, for a chain batch (None), chains of ``q``; padded requests chains of ``q``."""
    pad = chain(q)
    given = tuple(draft_parents) if draft_parents is not None else ()
    return given + (pad,) * (bucket - len(given))
