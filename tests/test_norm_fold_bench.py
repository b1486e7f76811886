"""benchmarks/experiments/bench_norm_fold.py compares two forms of the same math: both (the model's o projection, add,
RMSNorm, gate/up; and the form with the norm's scale moved past the product) against float64, eager, on the CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / "bench_norm_fold.py"


def test_both_forms_match_float64() -> None:
    spec = importlib.util.spec_from_file_location("bench_norm_fold", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    errors = module.check("cpu")
    assert set(errors) == {"unfolded", "folded"}
    assert max(errors.values()) < 1e-5, errors
