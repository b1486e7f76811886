"""Shared pytest setup: GPU tests skip cleanly without CUDA; Triton runs interpreted without CUDA;
hypothesis profiles for CI and GPU runs."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors under the interpreter. TRITON_INTERPRET is read when a kernel is
    # decorated, so it is set here, before any test module can import compile_attn's Triton kernels.
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import HealthCheck, settings

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
