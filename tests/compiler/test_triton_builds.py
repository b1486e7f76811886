"""``triton_builds`` counts the JIT builds of hand-written Triton kernels by name: one per new specialisation (an
argument of another alignment, a new constexpr), none for a call that hits the cache, and the compiled kernel
still runs. Needs a Triton that compiles (a GPU): the interpreter builds nothing."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_counts_one_build_per_new_specialisation() -> None:
    import triton
    import triton.language as tl

    from compile_attn.compiler.triton_builds import triton_builds

    @triton.jit
    def add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    assert triton_builds.install()
    before = triton_builds.snapshot()
    x = torch.zeros(64, device="cuda")
    add_one_kernel[(1,)](x, 64, BLOCK=64)  # n divisible by 16: one specialisation
    add_one_kernel[(1,)](x, 48, BLOCK=64)  # the same specialisation: a cache hit
    add_one_kernel[(1,)](x, 7, BLOCK=64)  # n not divisible by 16: a second build
    torch.cuda.synchronize()
    assert triton_builds.since(before) == {"add_one_kernel": 2}
    assert x[:7].tolist() == [3.0] * 7 and x[7:48].tolist() == [2.0] * 41 and x[48:].tolist() == [1.0] * 16
    specs = triton_builds.specialisations_since(before)
    assert len(specs) == 2 and all(s.startswith("add_one_kernel ") for s in specs)
    assert specs[0] != specs[1], "the two builds differ in n's specialisation"
