"""Shared pytest setup: GPU tests skip cleanly without CUDA; Triton runs interpreted without CUDA;
hypothesis profiles for CI and GPU runs; under pytest-xdist (``-n``) each worker takes its share of the CPU's
threads; one trained tiny Llama per step count for the whole run."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors under the interpreter. TRITON_INTERPRET is read when a kernel is
    # decorated, so it is set here, before any test module can import compile_attn's Triton kernels.
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import HealthCheck, settings

if (workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))) > 1:
    # N workers each with every core's worth of intra-op threads would oversubscribe the CPU N times over.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))

settings.register_profile(
    "default", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("gpu", deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not any keyword or id named "gpu"
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def trained_tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """``get(steps)``: the directory of the tiny Llama (``compile_attn.models.tiny_llama``) trained for ``steps``
    steps, trained once per test run and shared by every pytest-xdist worker (a file lock keeps two workers from
    training the same one at once). Read-only: a test that writes into a model directory copies it first."""
    from filelock import FileLock

    from compile_attn.models.tiny_llama import tiny_llama

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's folder above the workers'

    def get(steps: int) -> Path:
        out = shared / f"tiny-llama-{steps}-steps"
        with FileLock(f"{out}.lock"):
            return tiny_llama(out, steps=steps)

    return get
