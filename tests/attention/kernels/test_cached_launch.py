"""CachedLaunch on the CPU: when it may take the short path (installed Triton's launch form, launch hooks), and
that interpreted kernels always take Triton's regular path with the same results."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from compile_attn.attention.kernels import launch
from compile_attn.ops.triton_launch import is_interpreted
from compile_attn.attention.kernels.launch import CachedLaunch


def test_installed_triton_launch_form_is_the_one_mirrored() -> None:
    # If this fails, Triton changed how JITFunction.run launches: CachedLaunch then always takes the regular
    # path (correct, but slower); update launch.py to the new form.
    assert launch._SHORT_PATH


def test_an_active_launch_hook_turns_the_short_path_off() -> None:
    runtime = triton.knobs.runtime
    assert not launch._hooks_installed()
    hook = runtime.launch_enter_hook

    def record(metadata) -> None:  # noqa: ANN001
        pass

    if hasattr(hook, "add"):
        hook.add(record)
        try:
            assert launch._hooks_installed()
        finally:
            hook.remove(record)
    else:
        runtime.launch_enter_hook = record
        try:
            assert launch._hooks_installed()
        finally:
            runtime.launch_enter_hook = hook
    assert not launch._hooks_installed()


@triton.jit
def _fill_kernel(X, value, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(X + offs, value, mask=offs < n)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors; on a GPU the kernel is compiled (test_cached_launch_gpu)")
def test_interpreted_kernels_take_the_regular_path_every_time() -> None:
    cached = CachedLaunch(_fill_kernel)
    x = torch.zeros(8)
    for value in (3.0, 3.0, 5.0):
        cached((1,), x, value, 6, BLOCK=8)
        assert x.tolist() == [value] * 6 + [0.0, 0.0]
    if is_interpreted(_fill_kernel):
        assert (cached.fast, cached.slow) == (0, 3)
        assert cached.bind((1,), x, 5.0, 6, BLOCK=8) is None  # nothing to bind: no compiled kernel


def test_arguments_are_rebuilt_only_when_every_parameter_is_passed() -> None:
    cached = CachedLaunch(_fill_kernel)
    x = torch.zeros(8)
    assert cached._trailing_args(3, {"BLOCK": 8}) == (8,)  # constexprs only: a cache entry holds no tensor
    assert all(not isinstance(v, torch.Tensor) for v in cached._trailing_args(3, {"BLOCK": 8, "unused": x}))
    assert cached._trailing_args(3, {}) is None  # BLOCK left out: the launch could not be rebuilt
    assert not cached._usable


def test_call_key_tells_apart_what_triton_would_specialise_differently_and_holds_no_tensor() -> None:
    _call_key = launch._call_key
    t = torch.zeros(8, dtype=torch.int32)
    key = _call_key((t, 1, 2.0), {"BLOCK": 16})
    assert key == _call_key((t.view(8), 1, 2.0), {"BLOCK": 16})  # another view of the same memory and dtype
    for other in [
        ((t, 1.0, 2.0), {"BLOCK": 16}),  # int vs float compare equal in Python, not to Triton
        ((t, True, 2.0), {"BLOCK": 16}),
        ((t.view(torch.float32), 1, 2.0), {"BLOCK": 16}),  # same address, another dtype
        ((t[1:], 1, 2.0), {"BLOCK": 16}),  # another address
        ((t, 1, 2.0), {"BLOCK": 32}),
    ]:
        assert _call_key(*other) != key
    assert _call_key((t, object()), {}) is None  # neither scalar nor tensor: launched uncached

    def leaves(x):  # noqa: ANN001, ANN202
        return [y for item in x for y in leaves(item)] if isinstance(x, tuple) else [x]

    assert not any(isinstance(x, torch.Tensor) for x in leaves(key))
