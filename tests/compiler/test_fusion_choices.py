"""UnbackedFusionChoices: Inductor fuses a residual add, RMSNorm's reduction and its scaling over an unbacked
token count (as it does over a backed one), and the fused code matches a float64 reference."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.decorators import mark_unbacked
from torch._inductor.utils import run_and_get_code

from compile_attn.compiler.fusion_choices import FUSION_PATCHES, UnbackedFusionChoices, choices_handler

HIDDEN = 256


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _add_rmsnorm_linear(weight: torch.Tensor, proj: torch.Tensor):  # noqa: ANN202
    def fn(x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + residual
        variance = h.float().pow(2).mean(-1, keepdim=True)
        normed = weight * (h.float() * torch.rsqrt(variance + 1e-6)).to(h.dtype)
        return F.linear(normed, proj), h

    return fn


def _reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, proj: torch.Tensor):  # noqa: ANN202
    h = x.double() + residual.double()
    normed = weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return normed @ proj.double().T, h


class _Recording(UnbackedFusionChoices):
    decisions: list[tuple[bool, bool]] = []  # (a reduction is involved, fused)

    @staticmethod
    def can_fuse(scheduler, node1, node2, shared_data_score):  # noqa: ANN001, ANN205
        fused = UnbackedFusionChoices.can_fuse(scheduler, node1, node2, shared_data_score)
        _Recording.decisions.append((node1.is_reduction() or node2.is_reduction(), fused))
        return fused


def _compile_and_run(device: str, choices: dict, rows: int = 37):  # noqa: ANN202
    torch.manual_seed(0)
    weight = torch.randn(HIDDEN, device=device, dtype=torch.bfloat16)
    proj = torch.randn(2 * HIDDEN, HIDDEN, device=device, dtype=torch.bfloat16) / HIDDEN**0.5
    fn = torch.compile(_add_rmsnorm_linear(weight, proj), dynamic=False)
    x = torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    mark_unbacked(x, 0)
    mark_unbacked(residual, 0)
    with torch._inductor.config.patch({"force_disable_caches": True, **choices}), choices_handler(choices):
        (out, h), code = run_and_get_code(fn, x, residual)
    ref_out, ref_h = _reference(x, residual, weight, proj)
    torch.testing.assert_close(h.double(), ref_h, rtol=1e-2, atol=1e-2)  # bf16 rounding of the sum
    torch.testing.assert_close(out.double(), ref_out, rtol=3e-2, atol=3e-2)
    return code


def test_reduction_over_unbacked_rows_is_fused_and_correct():
    _Recording.decisions = []
    _compile_and_run("cpu", {"inductor_choices_class": _Recording})
    with_reduction = [fused for involves_reduction, fused in _Recording.decisions if involves_reduction]
    assert with_reduction and any(with_reduction), _Recording.decisions


def test_choices_handler_installs_the_configured_class_only():
    from torch._inductor.virtualized import V

    with choices_handler(FUSION_PATCHES):
        assert type(V.choices) is UnbackedFusionChoices
    with choices_handler({}):
        assert type(V.choices) is not UnbackedFusionChoices


def test_piece_compiler_uses_the_choices_unless_the_caller_turns_them_off():
    from compile_attn.compiler.piece_compiler import PieceCompiler

    assert PieceCompiler("inductor", None, {}).config_patches["inductor_choices_class"] is UnbackedFusionChoices
    off = PieceCompiler("inductor", None, {"inductor_choices_class": None}).config_patches
    assert off["inductor_choices_class"] is None


@pytest.mark.gpu
def test_add_rmsnorm_is_one_triton_kernel_over_unbacked_rows():
    """Inductor alone emits three Triton kernels here (add; sum of squares; scaling) on torch 2.11."""
    code = _compile_and_run("cuda", FUSION_PATCHES)
    kernels = re.findall(r"def (triton_\w+)\(", code[0])
    assert len(kernels) == 1, kernels
