"""CPU tests of the fa3 backend's guards (no sgl_kernel on the CPU CI): importing compile_attn never imports
sgl_kernel, choosing fa3 without it names the install command, and the device / compute-capability checks
point at the backends to use instead. The kernel itself is tested in test_fa3_gpu.py."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from compile_attn import AttentionLayer, KVCache, create_backend
from compile_attn.attention.registry import auto_backend_candidates, available_backends
from compile_attn.errors import BackendUnavailableError

SGL_KERNEL_INSTALLED = importlib.util.find_spec("sgl_kernel") is not None


def _cpu_cache() -> tuple[KVCache, list[AttentionLayer]]:
    kv = KVCache(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=2, max_context=32, kv_cache_tokens=64,
                 dtype=torch.bfloat16)
    return kv, [AttentionLayer(0, 8, 2, 64)]


def test_importing_compile_attn_and_the_fa3_module_does_not_import_sgl_kernel() -> None:
    code = (
        "import sys, compile_attn, compile_attn.attention.fa3.backend; "
        "print('sgl_kernel' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_fa3_is_a_known_backend_name() -> None:
    assert "fa3" in available_backends()


@pytest.mark.skipif(SGL_KERNEL_INSTALLED, reason="sgl_kernel is installed here")
def test_creating_fa3_without_sgl_kernel_names_the_install_command() -> None:
    kv, layers = _cpu_cache()
    with pytest.raises(BackendUnavailableError) as info:
        create_backend("fa3", kv, layers)
    message = str(info.value)
    assert 'pip install "compile-attn[fa3]"' in message
    assert "torch 2.11" in message and "CUDA 13" in message
    assert isinstance(info.value, ImportError)  # callers catching ImportError keep working


def test_auto_on_cpu_still_gives_torch_native() -> None:
    kv, layers = _cpu_cache()
    assert auto_backend_candidates(kv.device) == ["torch_native"]
    assert create_backend("auto", kv, layers).name == "torch_native"


def test_cpu_cache_is_refused_with_a_pointer_to_torch_native() -> None:
    from compile_attn.attention.fa3.backend import check_fa3_device

    with pytest.raises(BackendUnavailableError, match="torch_native"):
        check_fa3_device(torch.device("cpu"))


@pytest.mark.parametrize("capability", [(7, 5), (8, 7), (10, 0), (12, 0)])
def test_gpus_without_fa3_kernels_are_refused_naming_the_alternatives(capability: tuple[int, int]) -> None:
    from compile_attn.attention.fa3.backend import check_fa3_capability

    with pytest.raises(BackendUnavailableError) as info:
        check_fa3_capability(capability)
    message = str(info.value)
    assert f"sm{capability[0]}{capability[1]}" in message
    assert "flashinfer" in message and "triton" in message


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0)])
def test_gpus_with_fa3_kernels_pass_the_capability_check(capability: tuple[int, int]) -> None:
    from compile_attn.attention.fa3.backend import check_fa3_capability

    check_fa3_capability(capability)
