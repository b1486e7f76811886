"""Sampler: greedy rows, the sampled distribution, top-k / top-p support, seeded determinism."""

from __future__ import annotations

import torch

from compile_attn.engine.sampler import hashed_uniform, sample


def _params(n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    return dict(temperature=torch.full((n,), temperature), top_k=torch.full((n,), top_k, dtype=torch.int64),
                top_p=torch.full((n,), top_p), seeds=torch.arange(n, dtype=torch.int64),
                positions=torch.zeros(n, dtype=torch.int64))


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, **_params(64, temperature=0.0)), logits.argmax(-1))


def test_samples_follow_the_softmax_at_the_temperature() -> None:
    n, temp = 20000, 0.7
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(1)).repeat(n, 1)
    counts = torch.bincount(sample(logits, **_params(n, temperature=temp)), minlength=8).double()
    expected = (logits[0].double() / temp).softmax(-1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30, f"chi-square {chi2:.1f} over 7 degrees of freedom: samples do not follow the softmax"


def test_top_k_and_top_p_restrict_the_support() -> None:
    n = 5000
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(n, 1)
    assert set(sample(logits, **_params(n, top_k=2)).tolist()) == {0, 1}
    probs = logits[0].softmax(-1)  # [0.636, 0.234, 0.086, ...]: top_p 0.8 keeps tokens 0 and 1
    assert probs[0] < 0.8 < probs[0] + probs[1]
    assert set(sample(logits, **_params(n, top_p=0.8)).tolist()) == {0, 1}
    assert set(sample(logits, **_params(n, top_p=0.5)).tolist()) == {0}


def test_hashed_uniforms_are_deterministic_per_row_and_well_spread() -> None:
    u = hashed_uniform(torch.tensor([3, 3, 4]), torch.tensor([10, 10, 10]), 100000)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
