"""benchmarks/experiments/bench_kv_read_pattern.py reads what it claims to: both read kernels' sums against
float64 torch sums over the gathered slots (contiguous and shuffled, one and three splits). Interpreted on the CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "experiments" / "bench_kv_read_pattern.py"


def test_read_kernels_sum_the_gathered_kv(capsys):
    if torch.cuda.is_available():
        pytest.skip("the check runs under the interpreter here; on a GPU run the script with --check")
    spec = importlib.util.spec_from_file_location("bench_kv_read_pattern", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.INTERPRETED
    module.check()
    assert "match float64" in capsys.readouterr().out
