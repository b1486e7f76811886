"""Prompt lookup against a brute-force search of the definition, and the acceptance walk of a chain."""

from __future__ import annotations

import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_attn.engine.execution.speculative.acceptance import accept_chain
from compile_attn.engine.execution.speculative.ngram import NgramProposer


def lookup_by_definition(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The longest n in [lo, hi] whose last-n suffix occurs earlier (ending before the last token), its latest such
    occurrence, and the (up to) k tokens after it."""
    length = len(tokens)
    for n in range(min(hi, length - 1), lo - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=0, max_size=40), k=st.integers(1, 6), lo=st.integers(1, 4),
       extra=st.integers(0, 3))
def test_prompt_lookup_matches_the_definition(tokens: list[int], k: int, lo: int, extra: int) -> None:
    proposer = NgramProposer(k, lo, lo + extra)
    expected = lookup_by_definition(tokens, k, lo, lo + extra)
    assert proposer.propose(tokens) == expected
    assert proposer.propose(array.array("q", tokens)) == expected  # the engine's token arrays
    assert proposer.propose(tokens, max_tokens=1) == expected[:1]


def test_prompt_lookup_examples() -> None:
    p = NgramProposer(3, 2, 3)
    assert p.propose([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5, 9]  # the 3-gram 1 2 3
    assert p.propose([1, 2, 3, 4, 2, 3, 7, 2, 3]) == [7, 2, 3]  # the latest of two 2-gram occurrences
    assert p.propose([5, 6, 7, 8]) == []  # nothing repeats
    assert p.propose([1, 2, 3], max_tokens=0) == []


def test_accept_chain() -> None:
    assert accept_chain([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all drafts, then the bonus token
    assert accept_chain([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the first disagreement is the target's token
    assert accept_chain([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accept_chain([], [3]) == [3]  # a plain decode row
    with pytest.raises(ValueError, match="verified by 3 target tokens"):
        accept_chain([1, 2], [1])
