"""Statistical checks shared by the tests that sample: a chi-square goodness-of-fit of observed counts against the
counts a known distribution expects. It owns the test's mechanics (pooling rare cells, the degrees of freedom, the
limit); the sample count and the false-alarm rate stay with each test."""

from __future__ import annotations

import numpy as np
from scipy.stats import chi2 as chi2_dist


def assert_chi_square_fits(observed: np.ndarray, expected: np.ndarray, *, alpha: float, what: str = "") -> None:
    """Chi-square goodness of fit of ``observed`` counts to ``expected`` counts (any shape, flattened), failing with
    probability ``alpha`` when they do follow it. Cells expecting fewer than 5 counts are pooled into one (the
    chi-square approximation needs about 5 a cell); a cell that neither expects nor holds a count is left out."""
    observed = np.asarray(observed, dtype=np.float64).reshape(-1)
    expected = np.asarray(expected, dtype=np.float64).reshape(-1)
    keep = expected >= 5
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    live = (exp > 0) | (obs > 0)
    obs, exp = obs[live], exp[live]
    stat = float(((obs - exp) ** 2 / np.maximum(exp, 1e-9)).sum())
    dof = max(len(exp) - 1, 1)
    limit = chi2_dist.ppf(1 - alpha, dof)
    prefix = f"{what}: " if what else ""
    assert stat < limit, f"{prefix}chi-square {stat:.1f} over {dof} dof (limit {limit:.1f})"
