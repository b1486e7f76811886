"""Draft trees of verification steps (compile_attn/draft_tree.py) and ForwardBatch.build's checks of them.

The helpers are checked against definitions written out here (a token's ancestors by walking its parents, its depth
by counting the walk), never against each other."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_attn import ForwardBatch, ForwardMode, InvalidBatchError
from compile_attn.draft_tree import (
    ancestor_mask,
    ancestor_masks,
    chain,
    check_draft_parents,
    depths,
    has_tree,
    is_chain,
    tree_positions,
    verify_mask,
)


@st.composite
def parent_lists(draw: st.DrawFn, max_tokens: int = 12) -> tuple[int, ...]:
    """A random tree: token 0 the root, every other token's parent an earlier token."""
    n = draw(st.integers(1, max_tokens))
    return (-1, *(draw(st.integers(0, i - 1)) for i in range(1, n)))


def walk(parents: tuple[int, ...], i: int) -> list[int]:
    """i and its ancestors, by following parents to the root."""
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path


@settings(max_examples=60)
@given(parents=parent_lists())
def test_masks_and_depths_follow_the_parents(parents: tuple[int, ...]) -> None:
    n = len(parents)
    mask = ancestor_mask(parents)
    assert mask.dtype == torch.bool and mask.shape == (n, n)
    for i in range(n):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == set(walk(parents, i))
    assert depths(parents) == [len(walk(parents, i)) - 1 for i in range(n)]
    assert is_chain(parents) == (parents == chain(n))


@settings(max_examples=40)
@given(trees=st.lists(parent_lists(6), min_size=1, max_size=4), data=st.data())
def test_flat_masks_lay_out_each_request_row_by_row(trees: list[tuple[int, ...]], data: st.DataObject) -> None:
    prefix = [data.draw(st.integers(0, 9)) for _ in trees]
    window = data.draw(st.sampled_from([None, 1, 3, 8]))
    flat, offsets = ancestor_masks(trees)
    full = verify_mask(prefix, trees, window)
    assert flat.dtype == np.uint8 and offsets.tolist()[-1] == flat.size == sum(len(t) ** 2 for t in trees)
    assert full.size == sum(len(t) * (p + len(t)) for p, t in zip(prefix, trees))
    positions = tree_positions(prefix, trees)
    start = token = 0
    for b, (p, tree) in enumerate(zip(prefix, trees)):
        n = len(tree)
        block = flat[offsets[b]: offsets[b + 1]].reshape(n, n)
        rows = full[start: start + n * (p + n)].reshape(n, p + n)
        for i in range(n):
            q_pos = positions[token + i]
            assert q_pos == p + len(walk(tree, i)) - 1
            for j in range(p + n):
                k_pos = j if j < p else positions[token + j - p]
                allowed = (j < p or (j - p) in walk(tree, i)) and (window is None or k_pos > q_pos - window)
                assert rows[i, j] == allowed, (b, i, j)
                if j >= p:
                    assert block[i, j - p] == ((j - p) in walk(tree, i))
        start += n * (p + n)
        token += n


def test_has_tree_is_false_for_chains_and_single_tokens() -> None:
    assert not has_tree(None)
    assert not has_tree([chain(4), (-1,), ()])
    assert has_tree([chain(3), (-1, 0, 0)])


def _verify_batch(**over: object) -> ForwardBatch:
    args = dict(req_pool_indices=[1, 2, 3], prefix_lens=[5, 0, 7], extend_lens=[4, 2, 1],
                out_cache_loc=list(range(10, 17)), forward_mode=ForwardMode.TARGET_VERIFY,
                draft_parents=[(-1, 0, 0, 1), (-1, 0), (-1,)])
    args.update(over)
    return ForwardBatch.build(**args)


def test_build_keeps_the_tree_and_defaults_positions_to_prefix_plus_depth() -> None:
    fb = _verify_batch()
    assert fb.forward_mode is ForwardMode.TARGET_VERIFY and fb.forward_mode.is_verify()
    assert fb.draft_parents == ((-1, 0, 0, 1), (-1, 0), (-1,))
    assert fb.positions.tolist() == [5, 6, 6, 7, 0, 1, 7]
    assert _verify_batch(positions=[0] * 7).positions.tolist() == [0] * 7  # the caller's positions win
    chains = _verify_batch(draft_parents=None)
    assert chains.draft_parents is None and chains.positions.tolist() == [5, 6, 7, 8, 0, 1, 7]
    fb.validate()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(draft_parents=[(-1, 0, 0, 1), (-1, 0)]), "draft_parents has 2 entries but the batch has 3 requests"),
        (dict(draft_parents=[(-1, 0, 0), (-1, 0), (-1,)]), "request 0 has 3 parents but its extend_len is 4"),
        (dict(draft_parents=[(-1, 0, 0, 1), (0, 0), (-1,)]), "request 1: token 0 is the root .* got 0"),
        (dict(draft_parents=[(-1, 0, 3, 1), (-1, 0), (-1,)]), "request 0: token 2 has parent 3"),
        (dict(draft_parents=[(-1, 0, 0, 1), (-1, -1), (-1,)]), "request 1: token 1 has parent -1"),
        (dict(draft_parents=[(-1, 0, 0, 1), (-1, 0), (-1.5,)]), "one sequence of int parent indices"),
        (dict(forward_mode=ForwardMode.EXTEND), "forward_mode=ForwardMode.TARGET_VERIFY"),
        (dict(forward_mode=None), "forward_mode=ForwardMode.TARGET_VERIFY"),
    ],
)
def test_build_refuses_bad_draft_parents(change: dict, message: str) -> None:
    with pytest.raises(InvalidBatchError, match=message):
        _verify_batch(**change)


def test_validate_checks_draft_parents_of_assembled_batches() -> None:
    fb = _verify_batch()
    with pytest.raises(InvalidBatchError, match="request 2 has 2 parents but its extend_len is 1"):
        dataclasses.replace(fb, draft_parents=((-1, 0, 0, 1), (-1, 0), (-1, 0))).validate()
    with pytest.raises(InvalidBatchError, match="TARGET_VERIFY"):
        dataclasses.replace(fb, forward_mode=ForwardMode.EXTEND).validate()


def test_check_draft_parents_normalises_to_tuples() -> None:
    assert check_draft_parents([[-1, 0], np.array([-1])], [2, 1]) == ((-1, 0), (-1,))
