"""The sampling step's logprobs and penalties against float64 references written out per row in plain Python:
log-softmax read at the sampled token and the likeliest ones (ranks counted), the dicts moved to the host in vLLM's
shape; token counts built from ids and grown step by step on the device; presence / frequency / repetition
penalties as OpenAI and vLLM define them, neutral values leaving logits untouched."""

from __future__ import annotations

import math
import random

import pytest
import torch

from compile_attn.engine.execution.sampling.logprobs import Logprob, compute_logprobs, to_host
from compile_attn.engine.execution.sampling.penalties import add_tokens, apply_penalties, count_tokens

V = 50


def ref_logprobs(row: list[float]) -> list[float]:
    top = max(row)
    lse = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - lse for x in row]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_match_float64(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, V, generator=gen) * 3).to(dtype)
    tokens = torch.randint(0, V, (6,), generator=gen)
    step = compute_logprobs(logits, tokens, num_top=5)
    for i, row in enumerate(logits.double().tolist()):
        ref = ref_logprobs(row)
        t = int(tokens[i])
        assert step.sampled[i].item() == pytest.approx(ref[t], abs=1e-5)
        assert step.rank[i].item() == 1 + sum(x > ref[t] for x in ref)
        order = sorted(range(V), key=lambda j: -ref[j])[:5]
        if len({row[j] for j in order}) == 5:  # no ties among the likeliest (bfloat16 may have some)
            assert step.top_ids[i].tolist() == order
        assert step.top_logprobs[i].tolist() == pytest.approx(sorted(ref, reverse=True)[:5], abs=1e-5)
    assert step.top_ids.shape == (6, 5) and step.sampled.dtype == torch.float32


def test_to_host_gives_vllm_dicts() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 0.0, 0.0, 0.0], [1.0, 1.5, 0.5, 0.0]])
    tokens = torch.tensor([0, 0, 2])
    step = compute_logprobs(logits, tokens, num_top=2)
    out = to_host(step, [2, 1, 0])
    ref = [ref_logprobs(r) for r in logits.double().tolist()]
    assert list(out[0]) == [0, 3, 2]  # sampled first, then the likeliest two
    assert out[0][0] == Logprob(pytest.approx(ref[0][0], abs=1e-6), 4)
    assert out[0][3].rank == 1 and out[0][2].rank == 2
    assert list(out[1]) == [0] and out[1][0].rank == 1  # the sampled token is the likeliest: listed once
    assert list(out[2]) == [2] and out[2][2].rank == 3  # 1.5 and 1.0 are likelier
    assert out[2][2].logprob == pytest.approx(ref[2][2], abs=1e-6)
    empty = compute_logprobs(logits, tokens, num_top=0)
    assert [list(d) for d in to_host(empty, [0, 0, 0])] == [[0], [0], [2]]
    with pytest.raises(ValueError, match="num_top"):
        to_host(step, [3, 0, 0])


def ref_penalised(row: list[float], prompt: list[int], output: list[int], presence: float, frequency: float,
                  repetition: float) -> list[float]:
    out = []
    for tok, x in enumerate(row):
        if tok in prompt or tok in output:
            x = x / repetition if x > 0 else x * repetition
        n = output.count(tok)
        out.append(x - frequency * n - (presence if n else 0.0))
    return out


def random_rows(rng: random.Random, rows: int) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 12))] for _ in range(rows)]
    outputs = [[rng.randrange(V // 2) for _ in range(rng.randint(0, 20))] for _ in range(rows)]  # repeats likely
    return prompts, outputs


def flat(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([t for ts in lists for t in ts], dtype=torch.int64)
    rows = torch.tensor([i for i, ts in enumerate(lists) for _ in ts], dtype=torch.int64)
    return ids, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalties_match_float64(dtype: torch.dtype) -> None:
    rng = random.Random(1)
    rows = 5
    prompts, outputs = random_rows(rng, rows)
    logits = (torch.randn(rows, V, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    presence = torch.tensor([0.0, 0.5, -1.0, 2.0, 0.3])
    frequency = torch.tensor([0.0, 0.2, 0.7, -0.5, 0.0])
    repetition = torch.tensor([1.0, 1.3, 0.8, 1.0, 2.0])
    counts = count_tokens(*flat(outputs), rows, V)
    mask = count_tokens(*flat(prompts), rows, V) > 0
    got = apply_penalties(logits, counts, mask, presence, frequency, repetition)
    assert got.dtype == torch.float32 and got.shape == (rows, V)
    for i, row in enumerate(logits.double().tolist()):
        want = ref_penalised(row, prompts[i], outputs[i], presence[i].item(), frequency[i].item(),
                             repetition[i].item())
        assert got[i].tolist() == pytest.approx(want, abs=1e-5)
    assert torch.equal(got[0], logits[0].float())  # a neutral row is untouched


def test_counts_grow_on_the_device_step_by_step() -> None:
    rng = random.Random(2)
    prompts, outputs = random_rows(rng, 4)
    counts = count_tokens(*flat(prompts), 4, V)
    grown = counts.clone()
    for step in range(20):  # each step samples one token per row, possibly several rows the same token
        tokens = torch.tensor([rng.randrange(3) for _ in range(4)])
        add_tokens(grown, torch.arange(4), tokens)
        for i, t in enumerate(tokens.tolist()):
            prompts[i].append(t)
    assert torch.equal(grown, count_tokens(*flat(prompts), 4, V))
    for i, ts in enumerate(prompts):
        assert grown[i].tolist() == [ts.count(t) for t in range(V)]
    dup = torch.zeros(1, V, dtype=torch.int32)
    add_tokens(dup, torch.tensor([0, 0, 0]), torch.tensor([7, 7, 9]))  # repeated (row, token) pairs add up
    assert dup[0, 7].item() == 2 and dup[0, 9].item() == 1 and dup.sum().item() == 3


def test_shape_errors_name_the_argument() -> None:
    logits = torch.zeros(2, V)
    z = torch.zeros(2)
    with pytest.raises(ValueError, match="prompt_mask"):
        apply_penalties(logits, torch.zeros(2, V, dtype=torch.int32), torch.zeros(2, V - 1, dtype=torch.bool), z, z,
                        z + 1)
    with pytest.raises(ValueError, match="repetition"):
        apply_penalties(logits, torch.zeros(2, V, dtype=torch.int32), torch.zeros(2, V, dtype=torch.bool), z, z,
                        torch.ones(3))
    with pytest.raises(ValueError, match="num_top"):
        compute_logprobs(logits, torch.zeros(2, dtype=torch.int64), V + 1)


def test_penalty_state_follows_requests_through_rows() -> None:
    """Requests take rows, sample for a few steps (counted on the device), one is preempted and restarts in another
    row with its outputs so far; the penalised logits match the float64 reference of each request's own lists."""
    from compile_attn.engine.execution.sampling.penalties import PenaltyState

    rng = random.Random(3)
    state = PenaltyState(max_rows=4, vocab_size=V, device="cpu")
    prompts, outputs = random_rows(rng, 3)
    outputs = [[] for _ in prompts]
    rows = [2, 0, 3]
    for r, p in zip(rows, prompts):
        state.start(r, torch.tensor(p))
    params = [(0.4, 0.3, 1.2), (-0.5, 0.0, 0.9), (0.0, 1.0, 1.0)]
    presence, frequency, repetition = (torch.tensor(x) for x in zip(*params))
    gen = torch.Generator().manual_seed(3)
    for step in range(12):
        if step == 6:  # request 1 preempted: row 0 freed, later restarted in row 1 from its prompt and outputs
            state.start(0, torch.tensor([1, 2, 3]))  # someone else's request took row 0
            rows[1] = 1
            state.start(1, torch.tensor(prompts[1]), torch.tensor(outputs[1], dtype=torch.int64))
        logits = torch.randn(3, V, generator=gen) * 2
        got = state.apply(logits, torch.tensor(rows), presence, frequency, repetition)
        for i in range(3):
            want = ref_penalised(logits[i].double().tolist(), prompts[i], outputs[i], *params[i])
            assert got[i].tolist() == pytest.approx(want, abs=1e-5)
        tokens = got.argmax(-1) if step % 2 else torch.tensor([rng.randrange(4) for _ in range(3)])
        state.record(torch.tensor(rows), tokens)
        for i, t in enumerate(tokens.tolist()):
            outputs[i].append(t)
