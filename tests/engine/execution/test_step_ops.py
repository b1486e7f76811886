"""The device ops of a steady decode step outside the model forward, and the step's fused kernels.

A steady greedy decode step with overlap issues exactly four device ops around the forward (one upload of the
batch, its KV slots included; one kernel copying the inputs into the graph's buffers with the in-flight tokens fed
in and the slots written into the request table; the argmax; the tokens' copy back), at every batch size: a new op
fails the count. The Triton feed and decode copy (interpreted on the CPU) and the torch ops they replace all agree
with a plain Python reference on random inputs: placeholders, tokens outside the vocabulary, no placeholders, all
placeholders, table writes at unaligned offsets; the engine's overlapped greedy tokens are the serial loop's with
either.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compile_attn.graph_runner import step_kernels
from compile_attn.engine import LLM
from compile_attn.graph_runner.step_kernels import TokenFeed, copy_decode_inputs, feed_tokens, feed_tokens_torch
from compile_attn.bench.step_ops import D2H, H2D, steady_decode_ops

needs_kernels = pytest.mark.skipif(not step_kernels.kernels_usable(torch.empty(0)),
                                   reason="needs triton with TRITON_INTERPRET=1 (set by conftest)")


def reference_feed(ids: list[int], tokens: list[int], vocab: int | None) -> list[int]:
    """Placeholder ``-(i + 1)`` -> ``tokens[i]`` (``i`` clamped into the tokens), clamped into the vocabulary."""
    out = []
    for x in ids:
        if x < 0:
            x = tokens[min(max(-x - 1, 0), len(tokens) - 1)]
            if vocab:
                x = min(max(x, 0), vocab - 1)
        out.append(x)
    return out


VOCAB = 50


@st.composite
def feed_cases(draw: st.DrawFn) -> tuple[list[int], list[int], int | None]:
    """(input ids, in-flight tokens, vocabulary size): ids mix real ids and placeholders (none, some, all, and
    placeholders past the last token), tokens fall inside and outside the vocabulary."""
    tokens = draw(st.lists(st.integers(-3, VOCAB + 20), min_size=1, max_size=12))
    kind = draw(st.sampled_from(["mixed", "none", "all"]))
    real = st.integers(0, VOCAB - 1)
    placeholder = st.integers(-len(tokens) - 3, -1)
    entry = {"mixed": st.one_of(real, placeholder), "none": real, "all": placeholder}[kind]
    ids = draw(st.lists(entry, min_size=1, max_size=40))
    return ids, tokens, draw(st.sampled_from([VOCAB, None]))


@settings(max_examples=30, deadline=None)
@given(case=feed_cases())
def test_feed_torch_ops_match_the_reference(case: tuple[list[int], list[int], int | None]) -> None:
    ids, tokens, vocab = case
    fed = torch.tensor(ids)
    feed_tokens_torch(fed, torch.tensor(tokens), vocab)
    assert fed.tolist() == reference_feed(ids, tokens, vocab)


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(case=feed_cases())
def test_feed_kernel_matches_the_reference(case: tuple[list[int], list[int], int | None]) -> None:
    ids, tokens, vocab = case
    fed = torch.tensor(ids)
    feed_tokens(fed, torch.tensor(tokens), vocab)
    assert fed.tolist() == reference_feed(ids, tokens, vocab)


def reference_table_write(table: list[list[int]], rows: list[int], positions: list[int], slots: list[int]) -> None:
    """What a step's request-table write does: each request's new slot at its row and position."""
    for row, pos, slot in zip(rows, positions, slots):
        table[row][pos] = slot


@settings(max_examples=60, deadline=None)
@given(case=feed_cases(), offset=st.integers(0, 3), feed_on=st.booleans(), kernel=st.booleans(),
       table_on=st.booleans(), seed=st.integers(0, 2**16))
def test_decode_copy_matches_the_reference(case: tuple[list[int], list[int], int | None], offset: int,
                                           feed_on: bool, kernel: bool, table_on: bool, seed: int) -> None:
    """Six fields (int64 and int32) into views of larger buffers at an offset, by the kernel or by the torch ops
    (what runs without Triton); only the input ids are fed, and the kernel leaves the sources as they were. With
    ``table_on`` the request table (rows past a first row, so at a storage offset) also gets each request's slot
    at its row and position, the requests on distinct rows as a step's are, and nothing else of it changes."""
    if kernel and not step_kernels.kernels_usable(torch.empty(0)):
        return
    ids, tokens, vocab = case
    n = len(ids)
    gen = torch.Generator().manual_seed(seed)
    num_rows, context = n + 3, 11
    if table_on:  # valid rows and positions of the table; slots anywhere in int32
        fields = [torch.randint(0, context, (n,), generator=gen), torch.randint(0, 2**31 - 1, (n,), generator=gen),
                  torch.randperm(num_rows, generator=gen)[:n]]
    else:
        fields = [torch.randint(-2**31, 2**31 - 1, (n,), generator=gen) for _ in range(3)]
    srcs = [torch.tensor(ids)] + fields
    srcs += [torch.randint(-2**31, 2**31 - 1, (n,), generator=gen, dtype=torch.int32) for _ in range(2)]
    buffers = [torch.full((n + 8,), 7, dtype=s.dtype) for s in srcs]
    dsts = [b[offset:offset + n] for b in buffers]
    srcs = [torch.cat([torch.zeros(offset, dtype=s.dtype), s])[offset:] for s in srcs]  # unaligned, as a step's
    before = [s.clone() for s in srcs]
    whole = torch.randint(-9, 9, (num_rows + 1, context), generator=gen, dtype=torch.int32)
    expected_table = whole.tolist()
    table = whole[1:] if table_on else None
    if table_on:
        reference_table_write(expected_table[1:], *(s.tolist() for s in (srcs[3], srcs[1], srcs[2])))
    with contextlib.ExitStack() as stack:
        if not kernel:
            stack.enter_context(mock.patch.object(step_kernels, "kernels_usable", lambda t: False))
        copy_decode_inputs(dsts, srcs, TokenFeed(torch.tensor(tokens), vocab) if feed_on else None, table)
    expected_ids = reference_feed(ids, tokens, vocab) if feed_on else ids
    assert dsts[0].tolist() == expected_ids
    assert [d.tolist() for d in dsts[1:]] == [s.tolist() for s in before[1:]]
    assert all(torch.equal(s, b) for s, b in zip(srcs[1:], before[1:]))
    if kernel:
        assert torch.equal(srcs[0], before[0])
    for b in buffers:  # nothing written outside the destination views
        assert b[:offset].eq(7).all() and b[offset + n:].eq(7).all()
    assert whole.tolist() == expected_table


def test_decode_copy_refuses_a_table_it_cannot_index() -> None:
    fields = [torch.zeros(2, dtype=torch.int64) for _ in range(4)] + [torch.zeros(2, dtype=torch.int32)] * 2
    for table in (torch.zeros(4, 3, dtype=torch.int32).t(), torch.zeros(8, dtype=torch.int32)):
        with pytest.raises(ValueError, match="row-major 2-D request table"):
            copy_decode_inputs([f.clone() for f in fields], fields, None, table)


@pytest.fixture(scope="module")
def llm() -> LLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    return LLM(LlamaForCausalLM(cfg).eval(), attn_backend="triton", graph_mode="full", compile=False,
               max_batch_size=8, max_num_tokens=64, max_context=128, page_size=4, device="cpu",
               compile_options={"decode_batch_sizes": [1, 2, 4, 8]})


STEADY_DECODE_OPS = Counter({H2D: 1, "triton:_copy_decode_kernel": 1, "argmax.default": 1, D2H: 1})


@needs_kernels
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_steady_decode_step_issues_four_device_ops_outside_the_forward(llm: LLM, batch_size: int) -> None:
    """Counted per step over four steps (compile_attn/bench/step_ops.py); the LM head is one op beside them."""
    ops = steady_decode_ops(llm, batch_size)
    assert ops["step"] == STEADY_DECODE_OPS, f"batch {batch_size}: {dict(ops['step'])}"
    assert sum(ops["lm_head"].values()) == 1
    assert sum(ops["forward"].values()) > 10  # the forward was seen, and kept apart


@pytest.mark.gpu
def test_compiled_kernels_match_the_reference_without_a_sync_or_a_new_build() -> None:
    """On a GPU after ``warm_up``: batches of every size class at every offset into the buffers (what a step's
    views into one upload look like), every other one with the request-table write, build no new kernel, make no
    host sync, and feed, copy and write the table like the reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests.engine.first_traffic import record_builds

    dev = torch.device("cuda")
    step_kernels.warm_up(dev, VOCAB)
    gen = torch.Generator().manual_seed(0)
    context = 16
    cases = []
    for k, n in enumerate((1, 2, 15, 16, 17, 64, 255, 256, 257, 1000)):
        offset = n % 4
        tokens = torch.randint(-3, VOCAB + 20, (max(n // 2, 1),), generator=gen)
        ids = torch.where(torch.rand(n, generator=gen) < 0.5, torch.randint(0, VOCAB, (n,), generator=gen),
                          -torch.randint(1, tokens.numel() + 3, (n,), generator=gen))
        srcs = [ids, torch.randint(0, context, (n,), generator=gen), torch.randint(0, 2**31 - 1, (n,), generator=gen),
                torch.randperm(n + 3, generator=gen)[:n]]  # positions in the table, slots, distinct rows
        srcs += [torch.randint(0, 2**31 - 1, (n,), generator=gen, dtype=torch.int32) for _ in range(2)]
        big = [torch.cat([torch.zeros(offset, dtype=s.dtype), s]).to(dev)[offset:] for s in srcs]  # unaligned views
        dsts = [torch.zeros(n + offset, dtype=s.dtype, device=dev)[offset:] for s in srcs]
        fed = torch.cat([torch.zeros(offset, dtype=torch.int64), ids]).to(dev)[offset:]
        table = torch.full((n + 3, context), -1, dtype=torch.int32, device=dev) if k % 2 else None
        cases.append((ids, tokens, tokens.to(dev), big, dsts, fed, srcs, table))
    torch.cuda.synchronize()
    with record_builds() as builds:
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _, _, tokens_dev, big, dsts, fed, _, table in cases:
                copy_decode_inputs(dsts, big, TokenFeed(tokens_dev, VOCAB), table)
                feed_tokens(fed, tokens_dev, VOCAB)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert builds.triton_jit == []
    for ids, tokens, _, _, dsts, fed, srcs, table in cases:
        expected = reference_feed(ids.tolist(), tokens.tolist(), VOCAB)
        assert fed.tolist() == expected and dsts[0].tolist() == expected
        assert [d.tolist() for d in dsts[1:]] == [s.tolist() for s in srcs[1:]]
        if table is not None:
            expected_table = [[-1] * context for _ in range(table.shape[0])]
            reference_table_write(expected_table, srcs[3].tolist(), srcs[1].tolist(), srcs[2].tolist())
            assert table.tolist() == expected_table


def test_greedy_tokens_are_the_same_with_the_kernels_and_with_the_torch_ops(llm: LLM) -> None:
    """Overlapped greedy decoding with the step kernels, with the torch ops that run without Triton, and the serial
    loop (no placeholders to feed) give the same tokens."""
    from compile_attn.engine import SamplingParams

    prompts = [[(7 * i + 3 * j) % 128 for j in range(n)] for i, n in enumerate([3, 9, 5, 14, 2])]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = {}
    for name, overlap, kernels in (("serial", False, True), ("kernels", True, True), ("torch", True, False)):
        llm.overlap = overlap
        with contextlib.ExitStack() as stack:
            if not kernels:
                stack.enter_context(mock.patch.object(step_kernels, "kernels_usable", lambda t: False))
            runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.overlap = True
    assert runs["kernels"] == runs["serial"] and runs["torch"] == runs["serial"]
    assert all(len(t) == 12 for t in runs["serial"])
