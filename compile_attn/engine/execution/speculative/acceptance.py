"""Acceptance: which of a request's drafts its verify step keeps, given the target model's token at every draft row.

The verify step samples the target's token after each prefix of the drafts exactly as a decode step would at that
position (greedy rows: the argmax; sampled rows: the same sampler, temperature and filters, and for a seeded request
the same counter-based noise as at that position without speculation). The drafts are kept while each equals the
target's token before it; the first target token that differs (or the one after the last draft) is kept as well.
For proposals that are one token per position (n-gram lookup, a draft model's greedy chain), this is the rejection
rule with a point-mass draft distribution: the draft d is accepted with probability p(d), and when it is not the
token comes from p with d left out. So every output follows the target distribution exactly, and greedy and seeded
requests produce the same tokens with speculation on or off.
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_chain(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a request gains from one verify step: ``targets[i]`` is the target's token after the request's
    tokens and ``drafts[:i]`` (``len(drafts) + 1`` of them). Returns the accepted drafts followed by one target token
    (1 to ``len(drafts) + 1`` tokens)."""
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"a chain of {len(drafts)} drafts is verified by {len(drafts) + 1} target tokens, "
                         f"got {len(targets)}")
    out = []
    for i, t in enumerate(targets):
        out.append(t)
        if i == len(drafts) or drafts[i] != t:
            break
    return out
