"""What every attention backend must do, checked the same way for each installed one against the float64
reference: decode, extend, prefix and mixed batches (page sizes 1 and 16, GQA 1/4/8, a sliding window and a
softcap on one layer next to a full-attention layer), the pool written at the step's slots and nowhere else,
q/k/v given as strided views of a fused projection, zero output for a piecewise bucket's padding tokens,
``save_kv_cache=False`` honoured or refused by name, and
decode over the static graph buffers replaying new (some padded) batches per bucket.

On the CPU: torch_native, and triton under TRITON_INTERPRET. On a GPU (``gpu`` marker): torch_native, triton,
and flashinfer / fa3 and their hybrids where installed, in bfloat16, decode captured as CUDA graphs.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.attention.harness import TOL, Case, decode_replays, run_case

F32, BF16 = torch.float32, torch.bfloat16
W = {"window": 9, "logit_cap": 30.0}


@dataclass(frozen=True)
class Target:
    """A backend on a device: its name, dtype and constructor options, and whether it can skip the pool write."""

    backend: str
    device: str
    dtype: torch.dtype
    kwargs: dict = field(default_factory=dict)
    needs_saved_kv: frozenset[str] = frozenset()  # batch kinds where it reads the step's K/V from the pool, and
    # so refuses save_kv_cache=False by name


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


_ON_GPU = torch.cuda.is_available()
BOTH = ["decode", "prefix"]
# Few KV splits keep the interpreter quick while a 70-token request still runs several.
_TRITON_CPU = {"split_size": 32, "max_kv_splits": 4}
TARGETS = [
    pytest.param(Target("torch_native", "cpu", F32), id="torch_native-cpu"),
    pytest.param(Target("triton", "cpu", F32, _TRITON_CPU), id="triton-cpu",
                 marks=pytest.mark.skipif(_ON_GPU, reason="the Triton interpreter runs where there is no GPU")),
    pytest.param(Target("torch_native", "cuda", BF16), id="torch_native-gpu", marks=pytest.mark.gpu),
    pytest.param(Target("triton", "cuda", BF16), id="triton-gpu", marks=pytest.mark.gpu),
    *(pytest.param(Target(name, "cuda", BF16, needs_saved_kv=frozenset(kinds)), id=f"{name}-gpu",
                   marks=[pytest.mark.gpu, *(pytest.mark.skipif(not _installed(m), reason=f"needs {m}") for m in mods)])
      for name, kinds, mods in [
          ("flashinfer", BOTH, ["flashinfer"]),
          ("fa3", BOTH, ["sgl_kernel"]),
          # hybrids "<prefill>+<decode>": each batch kind goes to one part
          ("fa3+flashinfer", BOTH, ["sgl_kernel", "flashinfer"]),
          ("flashinfer+fa3", BOTH, ["sgl_kernel", "flashinfer"]),
          ("fa3+triton", ["prefix"], ["sgl_kernel"]),
          ("flashinfer+triton", ["prefix"], ["flashinfer"]),
      ]),
]

CASES = [
    pytest.param(Case.named("decode", group=1, page_size=1), id="decode-gqa1-p1"),
    pytest.param(Case.named("decode", group=4, page_size=16, **W), id="decode-gqa4-p16-window-cap"),
    pytest.param(Case.named("extend", group=1, page_size=16), id="extend-gqa1-p16"),
    pytest.param(Case.named("extend", group=8, page_size=1, **W), id="extend-gqa8-p1-window-cap"),
    pytest.param(Case.named("prefix", group=4, page_size=1), id="prefix-gqa4-p1"),
    pytest.param(Case.named("prefix", group=1, page_size=16, window=5), id="prefix-gqa1-p16-window"),
    pytest.param(Case.named("mixed", group=4, page_size=16), id="mixed-gqa4-p16"),
    pytest.param(Case.named("mixed", group=1, page_size=1, logit_cap=5.0), id="mixed-gqa1-p1-cap"),
]


def _check(target: Target, case: Case, **run: object) -> list:
    """Run ``case`` on ``target`` (run_case checks NaN-freedom and the pool writes) and check every layer's error."""
    results = run_case(case, target.device, target.dtype, backend_name=target.backend, backend_kwargs=target.kwargs,
                       **run)  # type: ignore[arg-type]
    for layer_id, result in enumerate(results):
        assert result.error < TOL[target.dtype], f"{target.backend} layer {layer_id}: error {result.error:.2e}"
    return results


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_reference(target: Target, case: Case) -> None:
    _check(target, case)


@st.composite
def random_cases(draw: st.DrawFn) -> Case:
    """A decode or extend batch of 1-4 requests, any page size, GQA group, window and softcap."""
    bs = draw(st.integers(1, 4))
    decode = draw(st.booleans())
    prefix = draw(st.lists(st.integers(1 if decode else 0, 40), min_size=bs, max_size=bs))
    extend = [1] * bs if decode else draw(st.lists(st.integers(1, 24), min_size=bs, max_size=bs))
    return Case(tuple(prefix), tuple(extend), num_kv_heads=draw(st.sampled_from([1, 2])),
                group=draw(st.sampled_from([1, 4, 8])), page_size=draw(st.sampled_from([1, 16])),
                window=draw(st.sampled_from([None, 1, 5, 17])), logit_cap=draw(st.sampled_from([0.0, 5.0])))


@pytest.mark.parametrize("target", TARGETS)
def test_random_batches_match_float64_reference(target: Target) -> None:
    interpreted = target.device == "cpu" and target.backend != "torch_native"

    @settings(max_examples=6) if interpreted else (lambda f: f)  # the interpreter takes seconds per batch
    @given(random_cases(), st.integers(0, 2**16))
    def check(case: Case, seed: int) -> None:
        _check(target, case, seed=seed)

    check()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", ["prefix", "mixed"])
def test_padding_tokens_of_a_piecewise_bucket_get_zero_output(target: Target, kind: str) -> None:
    for result in _check(target, Case.named(kind, group=4, page_size=16, **W), pad_tokens=5):
        assert result.pad_out.shape[0] == 5 and torch.count_nonzero(result.pad_out) == 0


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_strided_qkv_views_and_a_non_contiguous_output(target: Target, kind: str) -> None:
    """q/k/v as views of a fused projection's output (the token stride is the whole q|k|v row) and an output
    whose last dim is strided: stored and attended exactly as contiguous tensors (run_case compares the pool
    writes bit for bit)."""
    _check(target, Case.named(kind, group=4, page_size=16), strided=True)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", ["decode", "prefix"])
def test_without_saving_kv_the_pool_is_left_alone_or_the_call_is_refused(target: Target, kind: str) -> None:
    case = Case.named(kind, group=4, page_size=16, **W)
    if kind in target.needs_saved_kv:
        with pytest.raises(Exception, match="save_kv_cache=True"):
            run_case(case, target.device, target.dtype, backend_name=target.backend, save_kv_cache=False)
    else:
        _check(target, case, save_kv_cache=False)  # run_case asserts the pool is unchanged


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_over_static_graph_buffers_replays_new_batches_per_bucket(target: Target, page_size: int) -> None:
    """Bound (on a GPU: captured) once per bucket, then new batches, odd ones padded with PAD_REQUEST rows: every
    live output matches, padded outputs are finite, only the step's slots change."""
    report = decode_replays(target.device, target.dtype, buckets=(1, 4), trials=3, capture=target.device == "cuda",
                            max_len=90, page_size=page_size, backend_name=target.backend,
                            backend_kwargs=target.kwargs)
    assert report.trials == 6 and len(report.errors) == 12
    assert max(report.errors) < TOL[target.dtype], report.errors
