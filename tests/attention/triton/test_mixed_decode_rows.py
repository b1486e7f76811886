"""A mixed batch's leading decode rows in the triton decode kernel (``attention/triton/mixed.py``): random mixed
batches (decode rows, then prefill rows with and without cached prefixes) against the float64 reference, with the
backend's kernel table counted to show which kernel ran which rows (the real kernels run); batches that keep every
row on the extend kernel (decode rows after a prefill row, verify steps, draft trees, the switch off).

CPU tests run the kernels under TRITON_INTERPRET=1 at small sizes; the last test runs a realistic size on a GPU.
"""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import pytest
import torch
from tests.attention.harness import TOL, Case, chunked_reference, run_case
from tests.batch_factory import random_step

from compile_attn import ForwardBatch, ForwardMode, create_backend, forward_context
from compile_attn.attention.triton import backend as triton_backend
from compile_attn.attention.triton.mixed import leading_decode_rows
from compile_attn.env import MIXED_DECODE_ENV

F32, BF16 = torch.float32, torch.bfloat16
ON_GPU = torch.cuda.is_available()
cpu_only = pytest.mark.skipif(ON_GPU, reason="CPU interpreter tests; the GPU runs the realistic-size test")


class CountingOps:
    """The backend's kernel table (``attention/kernels``) with the rows of each decode and extend attention launch
    recorded; every call goes to the real kernel."""

    def __init__(self, ops: ModuleType) -> None:
        self._ops = ops
        self.decode_rows: list[int] = []
        self.extend_rows: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)

    def decode_attention_fwd(self, q: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.decode_rows.append(q.shape[0])
        self._ops.decode_attention_fwd(q, *args, **kwargs)

    def extend_attention_fwd(self, q: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.extend_rows.append(q.shape[0])
        self._ops.extend_attention_fwd(q, *args, **kwargs)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> CountingOps:
    """Backends made from now on launch through a ``CountingOps`` table."""
    ops = CountingOps(triton_backend.load_triton_ops())
    monkeypatch.setattr(triton_backend, "load_triton_ops", lambda: ops)
    return ops


def random_mixed(seed: int, **fields: Any) -> tuple[Case, int]:
    """A mixed batch: 1-5 decode rows (prefix 1-60), then 1-3 prefill rows (prefix 0-30, half of them 0; 2-20 new
    tokens), sometimes followed by a decode-like row; and how many leading decode rows it has."""
    rng = random.Random(seed)
    decode = rng.randint(1, 5)
    prefix = [rng.randint(1, 60) for _ in range(decode)]
    extend = [1] * decode
    for _ in range(rng.randint(1, 3)):
        prefix.append(0 if rng.random() < 0.5 else rng.randint(1, 30))
        extend.append(rng.randint(2, 20))
    if rng.random() < 0.5:  # a one-token chunk after the prefill rows: stays on the extend kernel
        prefix.append(rng.randint(1, 30))
        extend.append(1)
    return Case(tuple(prefix), tuple(extend), mode=ForwardMode.MIXED, **fields), decode


KWARGS = {"split_size": 16, "max_kv_splits": 4}  # several KV splits per decode row at these lengths

# Seeds whose batches have prefill rows with and without cached prefixes, most with a one-token row after them.
RANDOM_CASES = [
    pytest.param(seed, fields, dtype, id=f"seed{seed}-{name}-{'bf16' if dtype is BF16 else 'f32'}")
    for seed, (name, fields), dtype in [
        (15, ("gqa2-p1", {"num_kv_heads": 2, "group": 2, "page_size": 1}), F32),
        (18, ("gqa2-p4", {"num_kv_heads": 2, "group": 2, "page_size": 4}), F32),
        (20, ("gqa4-p4", {"num_kv_heads": 2, "group": 4, "page_size": 4}), BF16),
        (13, ("gqa2-p1-window-cap", {"num_kv_heads": 2, "group": 2, "window": 7, "logit_cap": 20.0}), F32),
        (12, ("gqa1-p4-dk96-dv64", {"num_kv_heads": 2, "group": 1, "page_size": 4, "head_dim": 96,
                                   "v_head_dim": 64}), BF16),
    ]
]


@cpu_only
@pytest.mark.parametrize("seed,fields,dtype", RANDOM_CASES)
def test_random_mixed_batch_matches_float64_reference(counted: CountingOps, seed: int, fields: dict,
                                                      dtype: torch.dtype) -> None:
    case, decode = random_mixed(seed, **fields)
    results = run_case(case, "cpu", dtype, seed=seed, backend_kwargs=KWARGS)
    for layer_id, result in enumerate(results):
        assert result.error < TOL[dtype], f"layer {layer_id}: relative error {result.error:.2e}"
    layers = len(results)
    assert counted.decode_rows == [decode] * layers, "the decode kernel did not run the leading decode rows"
    assert counted.extend_rows == [sum(case.extend) - decode] * layers


@cpu_only
@pytest.mark.parametrize("variant", ["padding", "no-save", "strided"])
def test_bucket_padding_unsaved_kv_and_strided_views(counted: CountingOps, variant: str) -> None:
    case = Case((20, 33, 0, 12), (1, 1, 9, 5), group=2, page_size=4, mode=ForwardMode.MIXED)
    kwargs = {"pad_tokens": 3} if variant == "padding" else {"save_kv_cache": False} if variant == "no-save" \
        else {"strided": True}
    (result,) = run_case(case, "cpu", F32, backend_kwargs=KWARGS, **kwargs)
    assert result.error < TOL[F32]
    if variant == "padding":
        assert torch.equal(result.pad_out, torch.zeros_like(result.pad_out)), "padding tokens' rows not zeroed"
    assert counted.decode_rows == [2] and counted.extend_rows == [14]


@cpu_only
@pytest.mark.parametrize("case", [
    pytest.param(Case((0, 20, 33), (6, 1, 1), group=2, mode=ForwardMode.MIXED), id="decode-rows-after-a-prefill"),
    pytest.param(Case((20, 33), (1, 1), group=2, mode=ForwardMode.EXTEND), id="decode-rows-only"),
    pytest.param(Case((20, 33, 8), (1, 1, 4), group=2, mode=ForwardMode.TARGET_VERIFY), id="verify"),
])
def test_batches_that_keep_every_row_on_the_extend_kernel(counted: CountingOps, case: Case) -> None:
    (result,) = run_case(case, "cpu", F32, backend_kwargs=KWARGS)
    assert result.error < TOL[F32]
    assert counted.decode_rows == [] and counted.extend_rows == [sum(case.extend)]


@cpu_only
@pytest.mark.parametrize("switch", ["kwarg", "env"])
def test_switched_off_every_row_runs_as_extend(counted: CountingOps, monkeypatch: pytest.MonkeyPatch,
                                                switch: str) -> None:
    kwargs = dict(KWARGS)
    if switch == "kwarg":
        kwargs["mixed_decode_rows"] = False
    else:
        monkeypatch.setenv(MIXED_DECODE_ENV, "0")
    case = Case((20, 33, 0), (1, 1, 9), group=2, mode=ForwardMode.MIXED)
    (result,) = run_case(case, "cpu", F32, backend_kwargs=kwargs)
    assert result.error < TOL[F32]
    assert counted.decode_rows == [] and counted.extend_rows == [11]


def test_leading_decode_rows_counts_the_leading_block_only() -> None:
    def batch(prefix: list[int], extend: list[int], mode: ForwardMode = ForwardMode.MIXED) -> ForwardBatch:
        loc = list(range(sum(extend)))
        return ForwardBatch.build(req_pool_indices=list(range(len(prefix))), prefix_lens=prefix, extend_lens=extend,
                                  out_cache_loc=loc, forward_mode=mode, device="cpu")

    assert leading_decode_rows(batch([5, 7, 0, 4], [1, 1, 8, 1])) == 2
    assert leading_decode_rows(batch([5, 0, 7], [1, 1, 8])) == 1  # a one-token prompt (no prefix) ends the block
    assert leading_decode_rows(batch([0, 5], [8, 1])) == 0
    assert leading_decode_rows(batch([5, 7], [1, 1], ForwardMode.EXTEND)) == 0  # no prefill part
    assert leading_decode_rows(batch([5, 7, 0], [1, 1, 8], ForwardMode.TARGET_VERIFY)) == 0
    trees = batch([5, 7, 3], [1, 1, 3], ForwardMode.TARGET_VERIFY)
    trees.draft_parents = ((-1,), (-1,), (-1, 0, 0))
    assert leading_decode_rows(trees) == 0


@cpu_only
def test_deterministic_decode_row_is_bitwise_its_decode_step_output() -> None:
    """With ``deterministic`` a decode row's output in a mixed step is bitwise what a decode step of it alone gives
    (the same kernel, splits and tile size), and both match the reference."""
    case = Case((40, 25, 0), (1, 1, 7), group=2, mode=ForwardMode.MIXED)
    kv = case.make_kv("cpu", F32)
    (layer,) = case.layers()
    step = random_step(kv, list(case.prefix), list(case.extend), case.num_heads, torch.Generator().manual_seed(3),
                       forward_mode=ForwardMode.MIXED)
    backend = create_backend("triton", kv, [layer], deterministic=True, **KWARGS)
    mixed_out = torch.empty(step.q.shape[0], case.num_heads, case.dv)
    backend.init_forward_metadata(step.batch)
    with forward_context(step.batch, backend):
        torch.ops.compile_attn.attention(step.q, step.k, step.v, mixed_out, 0, save_kv_cache=False)
    assert backend.step_metadata.decode_rows == 2
    decode = ForwardBatch.build(req_pool_indices=step.rows[:1], prefix_lens=step.prefix_lens[:1], extend_lens=[1],
                                out_cache_loc=step.batch.out_cache_loc[:1], device="cpu")
    decode_out = torch.empty(1, case.num_heads, case.dv)
    backend.init_forward_metadata(decode)
    with forward_context(decode, backend):
        torch.ops.compile_attn.attention(step.q[:1], step.k[:1], step.v[:1], decode_out, 0, save_kv_cache=False)
    assert torch.equal(mixed_out[:1], decode_out)
    expected = chunked_reference(step.q, step.k, step.v, *kv.pool.get_kv(0), kv.req_to_token, step.rows,
                                 step.prefix_lens, step.extend_lens, scaling=layer.scaling)
    assert float((mixed_out.double() - expected).abs().max() / expected.abs().max()) < TOL[F32]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_realistic_mixed_step_on_gpu(counted: CountingOps) -> None:
    """64 decode rows over ~1,000 cached tokens beside a 512-token chunk (with a cached prefix) and a fresh 300-token
    prompt, bf16, Llama-3.2-1B's head layout (32 q / 8 KV heads, head dim 64)."""
    rng = random.Random(0)
    prefix = tuple(rng.randint(900, 1100) for _ in range(64)) + (700, 0)
    case = Case(prefix, (1,) * 64 + (512, 300), num_kv_heads=8, group=4, page_size=16, mode=ForwardMode.MIXED)
    (result,) = run_case(case, "cuda", BF16, reference=chunked_reference)
    assert result.error < TOL[BF16], f"relative error {result.error:.2e}"
    assert counted.decode_rows == [64] and counted.extend_rows == [812]
