"""Verification steps (ForwardMode.TARGET_VERIFY) in every backend: draft trees, chains and one-token rows in one
batch against the float64 reference of tests/attention/verify_harness.py, and against each root-to-node path re-run
as a causal chain; which backends verify trees, and the refusal of those that do not.

On the CPU: torch_native, and triton under TRITON_INTERPRET (few, small cases: the interpreter is slow). On a GPU
(``gpu`` marker): torch_native, triton, flashinfer, fa3 (chains only) and hybrids, in bfloat16.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from tests.attention.harness import TOL
from tests.attention.verify_harness import VerifyCase, path_chain_outputs, run_verify, verify_cases
from tests.reference import max_rel_error

from compile_attn import UnsupportedConfigError, create_backend, forward_context
from compile_attn.attention.base import TREE_VERIFY_BACKENDS
from compile_attn.attention.hybrid import HybridBackend
from compile_attn.attention.torch_native.backend import TorchNativeBackend
from compile_attn.draft_tree import has_tree

F32, BF16 = torch.float32, torch.bfloat16
_ON_GPU = torch.cuda.is_available()
_TRITON_CPU = {"split_size": 32, "max_kv_splits": 4}
_CPU_TRITON = pytest.mark.skipif(_ON_GPU, reason="the Triton interpreter runs where there is no GPU")

# A tree with two branches and a chain of one (a decode row), a chain of four, a tree under an empty prefix.
MIXED = VerifyCase(prefix=(9, 5, 12, 0), parents=((-1, 0, 0, 1, 2, 2), (-1,), (-1, 0, 1, 2), (-1, 0, 0, 1)))
CASES = [
    pytest.param(MIXED, id="mixed-gqa2-p1"),
    pytest.param(VerifyCase(MIXED.prefix, MIXED.parents, page_size=4, window=3, logit_cap=5.0), id="window3-cap-p4"),
    pytest.param(VerifyCase((21, 2), ((-1, 0, 0, 0, 1, 4, 4), (-1, 0, 0)), group=1, page_size=4, window=5),
                 id="deep-window5-gqa1-p4"),
    pytest.param(VerifyCase((30,), ((-1, 0, 1, 0, 3),), window=1), id="window1"),
]


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _check(case: VerifyCase, backend: str, device: str, dtype: torch.dtype, kwargs: dict | None = None,
           chains: bool = True) -> None:
    run = run_verify(case, backend, device, dtype, backend_kwargs=kwargs)
    errors = run.errors()
    assert max(errors) <= TOL[dtype], f"errors per layer {errors}"
    if chains:  # the same outputs when each token's path runs alone as a causal extend
        for tree_out, chain_out in zip(run.outputs, path_chain_outputs(run, backend, kwargs)):
            assert max_rel_error(tree_out, chain_out.double()) <= TOL[dtype]


# ---------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("case", CASES)
def test_torch_native_verifies_trees(case: VerifyCase) -> None:
    _check(case, "torch_native", "cpu", F32)


@settings(max_examples=30, deadline=None)
@given(case=verify_cases())
def test_torch_native_verifies_random_trees(case: VerifyCase) -> None:
    _check(case, "torch_native", "cpu", F32)


@_CPU_TRITON
@pytest.mark.parametrize("case", CASES[1:3])
def test_triton_interpreted_verifies_trees(case: VerifyCase) -> None:
    _check(case, "triton", "cpu", F32, _TRITON_CPU)


@_CPU_TRITON
@settings(max_examples=12, deadline=None)
@given(case=verify_cases(max_requests=3, max_tokens=6, max_prefix=40))
def test_triton_interpreted_verifies_random_trees(case: VerifyCase) -> None:
    _check(case, "triton", "cpu", F32, _TRITON_CPU)


@pytest.mark.parametrize("backend", ["torch_native", pytest.param("triton", marks=_CPU_TRITON)])
def test_chains_without_draft_parents_are_causal_extends(backend: str) -> None:
    """TARGET_VERIFY without draft_parents: every request's tokens form a chain."""
    case = VerifyCase((7, 0, 3), ((-1, 0, 1), (-1, 0), (-1,)), window=2)
    kwargs = _TRITON_CPU if backend == "triton" else None
    run = run_verify(case, backend, "cpu", F32, backend_kwargs=kwargs, tree=False)
    assert run.batch.draft_parents is None and max(run.errors()) <= TOL[F32]


# ---------------------------------------------------------------------------------------- which backends verify trees
class _ChainsOnly(TorchNativeBackend):
    """A backend that verifies chains only, as fa3 does (the check in out_graph), to see the refusal on the CPU."""

    tree_verify = False

    def init_forward_metadata_out_graph(self, fb, in_capture: bool = False) -> None:  # noqa: ANN001
        self.check_tree_verify(fb)
        super().init_forward_metadata_out_graph(fb, in_capture)


def test_backends_declare_tree_verification() -> None:
    from compile_attn.attention.fa3.backend import FA3Backend
    from compile_attn.attention.flashinfer.backend import FlashInferBackend
    from compile_attn.attention.triton.backend import TritonBackend

    classes = {"torch_native": TorchNativeBackend, "triton": TritonBackend, "flashinfer": FlashInferBackend,
               "fa3": FA3Backend}
    assert sorted(TREE_VERIFY_BACKENDS) == sorted(n for n, cls in classes.items() if cls.tree_verify)


def test_a_backend_without_trees_refuses_them_by_name_and_runs_chains() -> None:
    case = VerifyCase((4, 6), ((-1, 0, 0), (-1, 0)))
    kv = case.make_kv("cpu", F32)
    backend = _ChainsOnly(kv, case.layers())
    assert not backend.supports_tree_verify()
    run = run_verify(VerifyCase((4, 6), ((-1, 0, 1), (-1, 0))), "torch_native", "cpu", F32)
    backend = _ChainsOnly(run.kv, case.layers())
    backend.init_forward_metadata(run.batch)  # chains (given as draft_parents) pass
    tree_run = run_verify(case, "torch_native", "cpu", F32)
    backend = _ChainsOnly(tree_run.kv, case.layers())
    with pytest.raises(UnsupportedConfigError, match=r"request 0's draft_parents \(-1, 0, 0\) are not a chain\); "
                                                     r"backends that can: triton, flashinfer, torch_native"):
        backend.init_forward_metadata(tree_run.batch)


@pytest.mark.parametrize("prefill_verifies", [True, False])
def test_hybrid_verifies_on_its_prefill_part(prefill_verifies: bool) -> None:
    tree_run = run_verify(MIXED, "torch_native", "cpu", F32)
    layers = MIXED.layers()
    prefill = TorchNativeBackend(tree_run.kv, layers) if prefill_verifies else _ChainsOnly(tree_run.kv, layers)
    hybrid = HybridBackend(tree_run.kv, layers, prefill=prefill, decode="torch_native")
    assert hybrid.supports_tree_verify() is prefill_verifies
    assert hybrid.part_for(tree_run.batch) is prefill
    if not prefill_verifies:
        with pytest.raises(UnsupportedConfigError, match="cannot verify draft trees"):
            hybrid.init_forward_metadata(tree_run.batch)
        return
    hybrid.init_forward_metadata(tree_run.batch)
    q, k, v = tree_run.inputs[0]
    out = torch.empty_like(tree_run.outputs[0])
    with forward_context(tree_run.batch, hybrid):
        torch.ops.compile_attn.attention(q, k, v, out, 0)
    torch.testing.assert_close(out, tree_run.outputs[0])


# ---------------------------------------------------------------------------------------- GPU
_GPU_CASES = [*CASES, pytest.param(VerifyCase((70, 300, 0), ((-1, 0, 0, 1, 1, 2, 2, 3), (-1,), (-1, 0, 0, 1)),
                                              num_kv_heads=2, group=4, page_size=16, window=64, logit_cap=30.0,
                                              head_dim=128), id="long-gqa4-p16-window64-cap-d128")]
_GPU_TREE_TARGETS = [
    pytest.param("torch_native", marks=pytest.mark.gpu),
    pytest.param("triton", marks=pytest.mark.gpu),
    pytest.param("flashinfer", marks=[pytest.mark.gpu, pytest.mark.skipif(not _installed("flashinfer"),
                                                                          reason="needs flashinfer")]),
    pytest.param("flashinfer+fa3", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not (_installed("flashinfer") and _installed("sgl_kernel")), reason="needs flashinfer and sgl_kernel")]),
]


@pytest.mark.parametrize("backend", _GPU_TREE_TARGETS)
@pytest.mark.parametrize("case", _GPU_CASES)
def test_gpu_backends_verify_trees(backend: str, case: VerifyCase) -> None:
    _check(case, backend, "cuda", BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["fa3", "fa3+flashinfer"])
def test_fa3_verifies_chains_and_refuses_trees(backend: str) -> None:
    pytest.importorskip("sgl_kernel")
    if "flashinfer" in backend:
        pytest.importorskip("flashinfer")
    chains = VerifyCase((9, 5, 40), ((-1, 0, 1, 2), (-1,), (-1, 0)), page_size=16, window=3, logit_cap=5.0)
    run = run_verify(chains, backend, "cuda", BF16)
    assert not has_tree(run.batch.draft_parents) and max(run.errors()) <= TOL[BF16]
    assert not run.backend.supports_tree_verify()
    with pytest.raises(UnsupportedConfigError, match="backends that can: triton, flashinfer, torch_native"):
        run_verify(MIXED, backend, "cuda", BF16)


@pytest.mark.gpu
def test_gpu_backends_report_tree_support() -> None:
    case = VerifyCase((4,), ((-1, 0),))
    kv = case.make_kv("cuda", BF16)
    assert create_backend("triton", kv, case.layers()).supports_tree_verify()
    assert create_backend("torch_native", kv, case.layers()).supports_tree_verify()
