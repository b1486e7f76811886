"""Backend registry: names, 'auto' on CPU, unknown names (also checked before anything is built), layer/pool
mismatch."""

from __future__ import annotations

import re

import pytest
import torch

from compile_attn import AttentionLayer, KVCache, UnknownBackendError, UnsupportedConfigError, create_backend
from compile_attn.attention import available_backends, check_backend_name
from compile_attn.attention.registry import auto_backend_candidates
from compile_attn.attention.torch_native.backend import TorchNativeBackend


def _kv() -> KVCache:
    return KVCache(num_layers=1, num_kv_heads=2, head_dim=8, max_batch_size=2, max_context=16, kv_cache_tokens=32)


def test_auto_picks_torch_native_on_cpu() -> None:
    assert isinstance(create_backend("auto", _kv(), [AttentionLayer(0, 4, 2, 8)]), TorchNativeBackend)


def test_unknown_backend_lists_known_ones() -> None:
    with pytest.raises(UnknownBackendError, match="unknown attention backend 'nope'; known backends: .*torch_native"):
        create_backend("nope", _kv(), [])
    assert "torch_native" in available_backends()


def test_layer_that_does_not_fit_the_pool_is_refused() -> None:
    with pytest.raises(UnsupportedConfigError, match="layer 0 has 4 KV heads of dim 8 but the KV pool holds 2"):
        create_backend("torch_native", _kv(), [AttentionLayer(0, 8, 4, 8)])


def test_layer_constants_are_checked() -> None:
    with pytest.raises(ValueError, match="num_heads \\(6\\) must be a multiple of num_kv_heads \\(4\\)"):
        AttentionLayer(0, 6, 4, 8)
    layer = AttentionLayer(0, 8, 2, 64)
    assert layer.scaling == pytest.approx(0.125) and layer.v_head_dim == 64 and layer.group_size == 4
    with pytest.raises(ValueError, match="sliding_window must be a positive"):
        AttentionLayer(0, 8, 2, 64, sliding_window=0)
    # the op is registered with the signature models trace (out is mutated in place, nothing returned)
    schema = str(torch.ops.compile_attn.attention.default._schema)
    assert schema.startswith("compile_attn::attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int layer_id")
    assert schema.endswith("-> ()")


def test_installed_backends_need_their_kernel_package(monkeypatch) -> None:
    from compile_attn.attention import installed_backends, registry

    assert "torch_native" in installed_backends()
    assert set(installed_backends()) <= set(available_backends())
    real = registry.module_available
    monkeypatch.setattr(registry, "module_available",
                        lambda module: module not in ("sgl_kernel", "flashinfer") and real(module))
    names = installed_backends()
    assert "fa3" not in names and "flashinfer" not in names
    assert "fa3" in available_backends()  # still a known name: create_backend explains what to install
    has_triton = real("triton")
    assert ("triton" in names) == has_triton
    assert ("hybrid" in names) == has_triton  # two kernel backends: triton + torch_native
    monkeypatch.setattr(registry, "module_available",
                        lambda module: module not in ("sgl_kernel", "flashinfer", "triton") and real(module))
    assert installed_backends() == ["torch_native"]


@pytest.mark.parametrize("name", ["auto", "torch_native", "triton", "hybrid", "fa3+flashinfer", "auto+torch_native"])
def test_check_backend_name_accepts_what_create_backend_knows(name: str) -> None:
    check_backend_name(name)  # no exception: known names, whether or not their kernel package is installed


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nope", "unknown attention backend 'nope'; known backends: "),
        ("triton+nope", "unknown attention backend 'nope' in 'triton+nope'"),
        ("hybrid+triton", "unknown attention backend 'hybrid' in 'hybrid+triton'"),
        ("triton+", "hybrid backend name 'triton+' must be '<prefill>+<decode>'"),
        ("a+b+c", "hybrid backend name 'a+b+c' must be '<prefill>+<decode>'"),
    ],
)
def test_check_backend_name_refuses_unknown_names(name: str, message: str) -> None:
    with pytest.raises(UnknownBackendError, match=re.escape(message)):
        check_backend_name(name)


def test_llm_checks_the_backend_name_and_graph_mode_before_loading_the_model() -> None:
    from compile_attn.engine import LLM

    with pytest.raises(UnknownBackendError, match="unknown attention backend 'nope'"):
        LLM("/no/such/model", attn_backend="nope")  # not FileNotFoundError: the name is checked first
    with pytest.raises(ValueError, match="unknown graph mode 'fast'"):
        LLM("/no/such/model", graph_mode="fast")


@pytest.mark.parametrize("capability,expected", [
    ((9, 0), ["triton", "fa3", "flashinfer", "torch_native"]),
    ((8, 0), ["triton", "flashinfer", "torch_native"]),
    ((7, 5), ["triton", "torch_native"]),
])
def test_auto_on_a_gpu_tries_triton_first(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int],
                                          expected: list[str]) -> None:
    """The measured-fastest backend first, the vendor kernels for models it refuses (every kernel package
    installed here by pretence; which GPU is the only input)."""
    from compile_attn.attention import registry

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(registry, "installed_backends", lambda: ["fa3", "flashinfer", "hybrid", "torch_native",
                                                                 "triton"])
    assert auto_backend_candidates(torch.device("cuda")) == expected
    monkeypatch.setattr(registry, "installed_backends", lambda: ["flashinfer", "torch_native"])  # no triton
    assert auto_backend_candidates(torch.device("cuda"))[0] == ("flashinfer" if capability >= (8, 0) else
                                                                "torch_native")
