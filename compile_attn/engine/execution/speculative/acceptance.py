"""Acceptance: which of a request's drafts its verify step keeps, given the target model's token at every draft row.

The verify step samples the target's token after each prefix of the drafts exactly as a decode step would at that
position (greedy rows: the argmax; sampled rows: the same sampler, temperature and filters, and for a seeded request
the same counter-based noise as at that position without speculation). The drafts are kept while each equals the
target's token before it; the first target token that differs (or the one after the last draft) is kept as well.
For proposals that are one token per position (n-gram lookup, a draft model's greedy chain), this is the rejection
rule with a point-mass draft distribution: the draft d is accepted with probability p(d), and when it is not the
token comes from p with d left out. So every output follows the target distribution exactly, and greedy and seeded
requests produce the same tokens with speculation on or off.

A tree (``accept_tree``) is walked from the root: the target's token at a node is kept, and the walk moves to the
child drafting that token, if there is one. The children of a node draft distinct tokens, so the token kept at each
depth is the target's sample there whatever the tree holds: the output distribution is the target's, as for a chain.
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


def accept_tree(drafts: Sequence[int], parents: Sequence[int], targets: Sequence[int]) -> tuple[list[int], list[int]]:
    """The tokens a request gains from verifying a draft tree, and the path of nodes that produced them.

    ``drafts[i]`` is node ``i + 1``'s token and ``parents[i]`` its parent among the drafts (-1: the root, node 0,
    the request's last token); ``targets[j]`` is the target's token after node ``j`` and its ancestors
    (``len(drafts) + 1`` of them). Returns (tokens, nodes): ``tokens[d]`` was sampled at node ``nodes[d]``, the root
    first; the accepted drafts are ``nodes[1:]``."""
    if not len(drafts) == len(parents) == len(targets) - 1:
        raise ValueError(f"a tree of {len(drafts)} drafts needs as many parents and {len(drafts) + 1} target tokens, "
                         f"got {len(parents)} and {len(targets)}")
    children: dict[int, dict[int, int]] = {}
    for i, (tok, parent) in enumerate(zip(drafts, parents)):
        children.setdefault(parent + 1, {}).setdefault(tok, i + 1)  # the first node of a token wins
    node, tokens, nodes = 0, [], []
    while True:
        tokens.append(targets[node])
        nodes.append(node)
        node = children.get(node, {}).get(targets[node], -1)
        if node < 0:
            return tokens, nodes
