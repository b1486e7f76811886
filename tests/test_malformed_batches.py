"""Malformed batches and bad constructor arguments end in named errors (CompileAttnError subclasses), never in a
crash, a raw torch error or a silently wrong result; a refused call leaves the KV pool, the request table and the
allocators as they were. Masked KV positions (the scratch slot, unused slots) never leak NaN into outputs.

torch_native runs in this process; the triton kernels run interpreted on the CPU (TRITON_INTERPRET=1, set by
conftest), and the cases that used to kill the process run in a child process so a crash fails one test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from tests.reference import max_rel_error, reference_attention
from torch.utils._python_dispatch import TorchDispatchMode

from compile_attn import (
    AttentionLayer,
    CompileAttnError,
    ForwardBatch,
    InvalidBatchError,
    InvalidConfigError,
    KVCache,
    create_backend,
    forward_context,
)
from compile_attn.batch import PAD_SLOT
from compile_attn.kv.pools import PagedKVPool, ReqToTokenPool

HEAD_DIM = 64  # the smallest head dim the triton kernels take
NUM_HEADS, NUM_KV_HEADS = 2, 1
BACKENDS = ["torch_native", "triton"]
on_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted triton; GPU runs its own tests")


# ---------------------------------------------------------------------------------------- setup and helpers
@dataclass
class Setup:
    kv: KVCache
    layer: AttentionLayer
    backend: object


def make(backend: str = "torch_native", page_size: int = 1, kv_cache_tokens: int = 64, max_context: int = 32,
         max_batch_size: int = 4, device: str = "cpu") -> Setup:
    kv = KVCache(num_layers=1, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, max_batch_size=max_batch_size,
                 max_context=max_context, kv_cache_tokens=kv_cache_tokens, page_size=page_size, dtype=torch.float32,
                 device=device)
    layer = AttentionLayer(layer_id=0, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    return Setup(kv, layer, create_backend(backend, kv, [layer]))


def fill_pool(kv: KVCache, gen: torch.Generator) -> None:
    """Random K/V in every slot (the prefixes' values; new tokens overwrite theirs)."""
    for buf in (*kv.pool.k_buffers, *kv.pool.v_buffers):
        buf.copy_(torch.randn(buf.shape, generator=gen))


def new_tokens(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(n, NUM_HEADS, HEAD_DIM, generator=gen), torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen),
            torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen))


def snapshot(kv: KVCache) -> dict:
    """Everything a step may change: pool bytes (NaN-proof), request table, page and row free lists, lengths."""
    return {
        "k": [b.view(torch.int32).clone() for b in kv.pool.k_buffers],
        "v": [b.view(torch.int32).clone() for b in kv.pool.v_buffers],
        "req_to_token": kv.req_to_token.clone(),
        "free_pages": list(kv.allocator._free),
        "allocated_pages": kv.allocator._allocated.copy(),
        "free_rows": list(kv.req_to_token_pool._free_rows),
        "lens": dict(kv._lens),
        "pages": {r: list(p) for r, p in kv._pages.items()},
    }


def assert_unchanged(kv: KVCache, before: dict) -> None:
    after = snapshot(kv)
    for name in ("k", "v"):
        assert all(torch.equal(a, b) for a, b in zip(after[name], before[name])), f"the pool's {name} changed"
    assert torch.equal(after["req_to_token"], before["req_to_token"]), "req_to_token changed"
    assert (after["allocated_pages"] == before["allocated_pages"]).all(), "page allocation changed"
    for name in ("free_pages", "free_rows", "lens", "pages"):
        assert after[name] == before[name], f"{name} changed"


def run_op(s: Setup, fb: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The public path: the backend's eager entry, then the attention op inside the forward context."""
    s.backend.init_forward_metadata(fb)
    out = torch.full_like(q, float("nan")) if out is None else out
    with forward_context(fb, s.backend):
        torch.ops.compile_attn.attention(q, k, v, out, s.layer.layer_id)
    return out


def reference(s: Setup, q, k, v, rows, prefix, extend) -> torch.Tensor:  # noqa: ANN001
    return reference_attention(q, k, v, s.kv.pool.k_buffers[0], s.kv.pool.v_buffers[0], s.kv.req_to_token, rows,
                               prefix, extend, scaling=s.layer.scaling)


def two_requests(s: Setup, prefix: tuple[int, int] = (3, 0), extend: tuple[int, int] = (1, 2)) -> dict:
    """Two live requests with ``prefix`` tokens cached; the next step's slots allocated: build() arguments."""
    rows = [s.kv.alloc_request(), s.kv.alloc_request()]
    s.kv.alloc_extend(rows, list(prefix))
    loc = s.kv.alloc_extend(rows, list(extend))
    return dict(req_pool_indices=rows, prefix_lens=list(prefix), extend_lens=list(extend), out_cache_loc=loc)


# ---------------------------------------------------------------------------------------- constructors
LAYER = dict(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=64)


@pytest.mark.parametrize(("change", "names"), [
    (dict(scaling=float("nan")), "scaling"), (dict(scaling=float("inf")), "scaling"), (dict(scaling=0.0), "scaling"),
    (dict(scaling=-0.1), "scaling"), (dict(logit_cap=float("nan")), "logit_cap"), (dict(logit_cap=-1.0), "logit_cap"),
    (dict(logit_cap=float("inf")), "logit_cap"), (dict(num_heads=0), "num_heads"),
    (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(head_dim=-64), "head_dim"), (dict(head_dim=64.5), "head_dim"), (dict(v_head_dim=0), "v_head_dim"),
    (dict(num_heads=6, num_kv_heads=4), "multiple of num_kv_heads"), (dict(sliding_window=0), "sliding_window"),
    (dict(sliding_window=2.5), "sliding_window"), (dict(layer_id=-1), "layer_id"), (dict(causal="yes"), "causal"),
])
def test_attention_layer_refuses_bad_values(change: dict, names: str) -> None:
    with pytest.raises(InvalidConfigError, match=names):
        AttentionLayer(**{**LAYER, **change})
    assert issubclass(InvalidConfigError, ValueError) and issubclass(InvalidConfigError, CompileAttnError)


KV = dict(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=2, max_context=8, kv_cache_tokens=16)


@pytest.mark.parametrize(("change", "message"), [
    (dict(num_kv_heads=0), "num_kv_heads must be a positive int, got 0"),
    (dict(page_size=0), "page_size must be a positive int, got 0"),
    (dict(page_size=-2), "page_size must be a positive int, got -2"),
    (dict(kv_cache_tokens=0), "kv_cache_tokens .* must be a positive int, got 0"),
    (dict(max_context=0), "max_context must be a positive int, got 0"),
    (dict(max_batch_size=-1), "max_batch_size must be a positive int, got -1"),
    (dict(num_layers=0), "num_layers must be a positive int, got 0"),
    (dict(head_dim=0), "head_dim must be a positive int, got 0"),
    (dict(dtype=torch.int8), "dtype torch.int8 is not supported; supported: float16, bfloat16, float32"),
    (dict(dtype=torch.bool), "dtype torch.bool is not supported"),
])
def test_kv_cache_refuses_bad_values(change: dict, message: str) -> None:
    with pytest.raises(InvalidConfigError, match=message):
        KVCache(**{**KV, **change})


def test_pools_refuse_bad_values() -> None:
    pool = dict(num_pages=4, page_size=1, num_layers=1, num_kv_heads=1, head_dim=8)
    with pytest.raises(InvalidConfigError, match="page_size must be a positive int, got 0"):
        PagedKVPool(**{**pool, "page_size": 0})
    with pytest.raises(InvalidConfigError, match="num_kv_heads must be a positive int, got 0"):
        PagedKVPool(**{**pool, "num_kv_heads": 0})
    with pytest.raises(InvalidConfigError, match="dtype torch.int8 is not supported"):
        PagedKVPool(**pool, dtype=torch.int8)
    with pytest.raises(InvalidConfigError, match="max_batch_size must be a positive int, got 0"):
        ReqToTokenPool(0, 8)
    with pytest.raises(InvalidConfigError, match="max_context must be a positive int, got 0"):
        ReqToTokenPool(2, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_create_backend_refuses_a_layer_past_the_cache(backend: str) -> None:
    kv = KVCache(**{**KV, "num_layers": 2}, dtype=torch.float32)
    layers = [AttentionLayer(**{**LAYER, "layer_id": i}) for i in (0, 2)]
    with pytest.raises(InvalidConfigError, match="layer_id 2 is past the KV cache's 2 layers .*num_layers=3"):
        create_backend(backend, kv, layers)


# ---------------------------------------------------------------------------------------- build() and alloc_extend
@pytest.mark.parametrize(("change", "message"), [
    (dict(extend_lens=[1, 4]), "extend_lens \\[1, 4\\] sum to 5 tokens but out_cache_loc has 3 entries"),
    (dict(extend_lens=[1, 1]), "sum to 2 tokens but out_cache_loc has 3 entries"),
    (dict(prefix_lens=[-2, 0]), "request 0: .* must be >= 0, got prefix_len=-2"),
    (dict(prefix_lens=[3, 1], extend_lens=[-1, 4]), "request 0: .* got prefix_len=3, extend_len=-1"),
    (dict(req_pool_indices=[1, -1]), "request 1: .*req_pool_index=-1"),
    (dict(prefix_lens=[3]), "one entry per request; got lengths 2, 1, 2"),
    (dict(extend_lens=[1, 2.5]), "extend_lens must be a sequence of ints, got 2.5"),
    (dict(input_ids=[1, 2]), "sum to 3 tokens but input_ids has 2 entries"),
    (dict(positions=torch.zeros(3, 1, dtype=torch.int64)), "positions must be 1-D"),
    (dict(out_cache_loc=[1.5, 2, 3]), "must hold int64 values"),
    (dict(out_cache_loc=torch.tensor([1.0, 2.0, 3.0])), "out_cache_loc must hold integers, got dtype torch.float32"),
    (dict(input_ids=[1, 2, 2**70]), "must hold int64 values"),
    (dict(prefix_lens=None), "prefix_lens must be a sequence of ints, got NoneType None"),
    (dict(forward_mode=2), "forward_mode DECODE needs extend_len 1 for every request, got \\[1, 2\\]"),
])
def test_build_refuses_inconsistent_host_lists(change: dict, message: str) -> None:
    s = make()
    args = two_requests(s)
    before = snapshot(s.kv)
    with pytest.raises(InvalidBatchError, match=message):
        ForwardBatch.build(**{**args, **change})
    assert_unchanged(s.kv, before)


def test_alloc_extend_refuses_mismatched_lengths() -> None:
    kv = make().kv
    rows = [kv.alloc_request(), kv.alloc_request()]
    before = snapshot(kv)
    for lens in ([1], [1, 1, 1], [2]):
        with pytest.raises(InvalidBatchError, match=f"one extend_len per request row, got 2 rows .* {len(lens)} "):
            kv.alloc_extend(rows, lens)
        assert_unchanged(kv, before)


# ---------------------------------------------------------------------------------------- batches against the cache
def _case_extend_5_of_3(s: Setup, a: dict) -> dict:
    return {**a, "req_pool_indices": a["req_pool_indices"][:1], "prefix_lens": [3], "extend_lens": [5],
            "out_cache_loc": a["out_cache_loc"][:3]}


CACHE_CASES: dict[str, tuple[Callable[[Setup, dict], dict], str]] = {
    "extend-lens-5-with-3-tokens": (_case_extend_5_of_3, "sum to 5 tokens but out_cache_loc has 3 entries"),
    "negative-prefix": (lambda s, a: {**a, "prefix_lens": [-2, 0]}, "must be >= 0, got prefix_len=-2"),
    "slot-10**6": (lambda s, a: {**a, "out_cache_loc": torch.tensor([*a["out_cache_loc"][:2].tolist(), 10**6])},
                   "out_cache_loc\\[2\\] is slot 1000000, outside the KV pool's slots 0..64"),
    "slot-minus-1": (lambda s, a: {**a, "out_cache_loc": torch.tensor([-1, *a["out_cache_loc"][1:].tolist()])},
                     "out_cache_loc\\[0\\] is slot -1, outside"),
    "slot-of-another-request": (lambda s, a: {**a, "out_cache_loc": a["out_cache_loc"].flip(0)},
                                "out_cache_loc\\[0\\] is slot .* but token 0 \\(request row 1, position 3\\)"),
    "slot-pad": (lambda s, a: {**a, "out_cache_loc": torch.tensor([PAD_SLOT, *a["out_cache_loc"][1:].tolist()])},
                 "out_cache_loc\\[0\\] is slot 0, but token 0"),
    "row-99": (lambda s, a: {**a, "req_pool_indices": [99, a["req_pool_indices"][1]]},
               "request 0: req_pool_indices value 99 is not an allocated request row"),
    "row-99-alone": (lambda s, a: {**a, "req_pool_indices": [99], "prefix_lens": [3], "extend_lens": [1],
                                   "out_cache_loc": a["out_cache_loc"][:1]}, "value 99 is not an allocated"),
    "row-pad-request": (lambda s, a: {**a, "req_pool_indices": [0, a["req_pool_indices"][1]]},
                        "value 0 is not an allocated request row"),
    "row-twice": (lambda s, a: {**a, "req_pool_indices": [a["req_pool_indices"][0]] * 2, "prefix_lens": [3, 2]},
                  "request row 1 appears twice in one batch"),
    "prefix-past-the-row": (lambda s, a: {**a, "prefix_lens": [9, 0]},
                            "request 0 \\(row 1\\): prefix_len 9 \\+ extend_len 1 = 10 tokens but the row has 4"),
    "prefix-past-max-context": (lambda s, a: {**a, "prefix_lens": [40, 0]}, "prefix_len 40 .* the row has 4"),
}


@pytest.mark.parametrize("case", CACHE_CASES)
def test_torch_native_refuses_malformed_batches_with_nothing_written(case: str) -> None:
    s = make("torch_native")
    gen = torch.Generator().manual_seed(0)
    fill_pool(s.kv, gen)
    change, message = CACHE_CASES[case]
    args = change(s, two_requests(s))
    before = snapshot(s.kv)
    with pytest.raises(InvalidBatchError, match=message):
        fb = ForwardBatch.build(**args)
        q, k, v = new_tokens(fb.num_tokens, gen)
        run_op(s, fb, q, k, v)
    assert_unchanged(s.kv, before)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_engines_batches_are_checked_without_touching_a_tensor() -> None:
    """A batch whose out_cache_loc is what alloc_extend returned for its rows (how the engine builds steps) is
    trusted with list comparisons; a hand-built copy of it is checked against the request table; after a free,
    the cache trusts nothing it handed out before."""
    s = make()
    args = two_requests(s)
    engine_fb = ForwardBatch.build(**args)
    assert engine_fb.out_cache_loc is args["out_cache_loc"]
    with _CountOps() as counted:
        engine_fb.check(s.kv)
    assert counted.ops == []
    by_hand = ForwardBatch.build(**{**args, "out_cache_loc": args["out_cache_loc"].tolist()})
    with _CountOps() as counted:
        by_hand.check(s.kv)
    assert any("index" in op for op in counted.ops)  # the slots compared with req_to_token
    other = s.kv.alloc_request()
    s.kv.free_request(other)
    with _CountOps() as counted:
        engine_fb.check(s.kv)
    assert counted.ops
    s.kv.free_request(args["req_pool_indices"][1])
    with pytest.raises(InvalidBatchError, match="request 1: req_pool_indices value 2 is not an allocated"):
        engine_fb.check(s.kv)


def test_the_op_checks_a_batch_that_skipped_the_eager_entry() -> None:
    """torch_native's extend needs no metadata: a batch that never went through init_forward_metadata is still
    checked before anything is written."""
    s = make("torch_native")
    args = two_requests(s, prefix=(0, 0), extend=(2, 3))
    fb = ForwardBatch.build(**{**args, "req_pool_indices": [99, args["req_pool_indices"][1]]})
    q, k, v = new_tokens(5, torch.Generator().manual_seed(1))
    before = snapshot(s.kv)
    with pytest.raises(InvalidBatchError, match="value 99 is not an allocated"), forward_context(fb, s.backend):
        torch.ops.compile_attn.attention(q, k, v, torch.empty_like(q), 0)
    assert_unchanged(s.kv, before)


def _issue_cases(device: str) -> dict[str, str]:
    """Run every CACHE_CASES case through the triton backend; 'ErrorName: message' (or 'ok') by case."""
    results = {}
    for case, (change, _) in CACHE_CASES.items():
        s = make("triton", device=device)
        gen = torch.Generator().manual_seed(0)
        fill_pool(s.kv, gen)
        args = change(s, two_requests(s))
        before = snapshot(s.kv)
        try:
            fb = ForwardBatch.build(**args, device=device)
            run_op(s, fb, *(t.to(device) for t in new_tokens(fb.num_tokens, gen)))
            results[case] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            results[case] = f"{type(exc).__name__}: {exc}"
        try:
            assert_unchanged(s.kv, before)
        except AssertionError as exc:
            results[case] += f" | state changed: {exc}"
    return results


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=on_cpu_only), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_triton_refuses_malformed_batches_without_crashing(device: str) -> None:
    """The batches that used to end the process (SIGSEGV or a glibc abort interpreted on the CPU, an illegal
    memory access compiled on a GPU), in a child process so that a crash fails this test."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")])}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), device], capture_output=True, text=True,
                          env=env, cwd=os.path.dirname(here), timeout=600)
    assert proc.returncode == 0, f"the child process died (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, (_, message) in CACHE_CASES.items():
        got = results[case]
        assert got.startswith("InvalidBatchError: ") and "state changed" not in got, f"{case}: {got}"
        assert __import__("re").search(message, got), f"{case}: {got}"


# ---------------------------------------------------------------------------------------- q/k/v/out shapes
SHAPE_CASES = {
    "q-heads": (lambda q, k, v, o: (q[:, :1], k, v, o[:, :1]), "q has shape \\(3, 1, 64\\), expected \\(3, 2, 64\\)"),
    "k-tokens": (lambda q, k, v, o: (q, k[:2], v, o), "k has shape \\(2, 1, 64\\), expected \\(3, 1, 64\\)"),
    "v-head-dim": (lambda q, k, v, o: (q, k, v[..., :32], o), "v has shape \\(3, 1, 32\\), expected \\(3, 1, 64\\)"),
    "q-tokens": (lambda q, k, v, o: (q[:2], k, v, o), "q has shape \\(2, 2, 64\\)"),
    "out-dtype": (lambda q, k, v, o: (q, k, v, o.double()), "share one floating dtype, got q torch.float32, .*out "
                  "torch.float64"),
    "k-dtype": (lambda q, k, v, o: (q, k.half(), v, o), "got q torch.float32, k torch.float16"),
    "int-inputs": (lambda q, k, v, o: (q.int(), k.int(), v.int(), o.int()), "share one floating dtype"),
}


@pytest.mark.parametrize("backend", [pytest.param("torch_native"), pytest.param("triton", marks=on_cpu_only)])
@pytest.mark.parametrize("case", SHAPE_CASES)
def test_inputs_are_checked_before_any_kv_is_written(backend: str, case: str) -> None:
    s = make(backend)
    args = two_requests(s)
    fb = ForwardBatch.build(**args)
    gen = torch.Generator().manual_seed(2)
    q, k, v = new_tokens(3, gen)
    q, k, v, out = SHAPE_CASES[case][0](q, k, v, torch.empty_like(q))
    s.backend.init_forward_metadata(fb)
    before = snapshot(s.kv)
    with pytest.raises(InvalidBatchError, match=SHAPE_CASES[case][1] + ".*nothing was written"), \
            forward_context(fb, s.backend):
        torch.ops.compile_attn.attention(q, k, v, out, 0)
    assert_unchanged(s.kv, before)


# ---------------------------------------------------------------------------------------- NaN in masked slots
@pytest.mark.parametrize("backend", [pytest.param("torch_native"), pytest.param("triton", marks=on_cpu_only)])
@pytest.mark.parametrize(("prefix", "extend"), [
    pytest.param([5, 17, 2, 9], [1, 1, 1, 1], id="decode"),
    pytest.param([0, 9, 3, 6], [4, 1, 7, 2], id="extend"),
    pytest.param([7, 0, 12, 1], [1, 5, 1, 3], id="mixed"),
])
@pytest.mark.parametrize("page_size", [1, 4])
def test_nan_in_scratch_and_unused_slots_never_reaches_outputs(backend: str, prefix: list[int], extend: list[int],
                                                               page_size: int) -> None:
    s = make(backend, page_size=page_size, kv_cache_tokens=96, max_batch_size=6)
    gen = torch.Generator().manual_seed(3)
    fill_pool(s.kv, gen)
    # a request allocated and freed leaves stale slots and a reset table row behind
    old = s.kv.alloc_request()
    s.kv.alloc_extend([old], [11])
    s.kv.free_request(old)
    rows = [s.kv.alloc_request() for _ in prefix]
    s.kv.alloc_extend(rows, prefix)
    loc = s.kv.alloc_extend(rows, extend)
    live = {int(x) for r, p, e in zip(rows, prefix, extend) for x in s.kv.req_to_token[r, :p + e]}
    unused = [slot for slot in range(s.kv.pool.num_slots) if slot not in live]
    assert PAD_SLOT in unused
    for buf in (s.kv.pool.k_buffers[0], s.kv.pool.v_buffers[0]):
        buf[unused] = float("nan")
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=prefix, extend_lens=extend, out_cache_loc=loc)
    q, k, v = new_tokens(fb.num_tokens, gen)
    out = run_op(s, fb, q, k, v)
    assert not out.isnan().any() and not out.isinf().any()
    assert max_rel_error(out, reference(s, q, k, v, rows, prefix, extend)) < 1e-4


# ---------------------------------------------------------------------------------------- fuzz
CORRUPTIONS = ["none", "none", "extend-sum", "negative-prefix", "negative-extend", "short-list", "row-out-of-range",
               "row-unallocated", "row-twice", "prefix-too-long", "slot-big", "slot-negative", "slot-pad",
               "slot-swapped", "q-heads", "k-tokens"]


@st.composite
def batches(draw: st.DrawFn) -> dict:
    n = draw(st.integers(1, 3))
    return dict(
        page_size=draw(st.sampled_from([1, 4])),
        prefix=draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)),
        extend=[draw(st.integers(1 if i == 0 else 0, 4)) for i in range(n)],
        corruption=draw(st.sampled_from(CORRUPTIONS)),
        which=draw(st.integers(0, n - 1)),
        amount=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**16)),
    )


def _corrupt(kind: str, args: dict, which: int, amount: int, num_slots: int) -> dict:
    rows, prefix, extend = list(args["req_pool_indices"]), list(args["prefix_lens"]), list(args["extend_lens"])
    loc = args["out_cache_loc"].clone()
    if kind == "extend-sum":
        extend[which] += amount
    elif kind == "negative-prefix":
        prefix[which] = -amount
    elif kind == "negative-extend":
        extend[which] = -amount
    elif kind == "short-list":
        prefix = prefix[:-1]
    elif kind == "row-out-of-range":
        rows[which] = 99
    elif kind == "row-unallocated":
        rows[which] = 0 if amount == 1 else max(rows) + amount  # PAD_REQUEST or a free row
    elif kind == "row-twice" and len(rows) > 1:
        rows[which] = rows[which - 1]
    elif kind == "prefix-too-long":
        prefix[which] += amount
    elif kind in ("slot-big", "slot-negative", "slot-pad", "slot-swapped") and loc.numel():
        i = which % loc.numel()
        loc[i] = {"slot-big": num_slots + 10**6, "slot-negative": -amount, "slot-pad": PAD_SLOT,
                  "slot-swapped": int(loc[i]) + amount}[kind]
    return dict(req_pool_indices=rows, prefix_lens=prefix, extend_lens=extend, out_cache_loc=loc)


def fuzz_one(backend: str, b: dict) -> str:
    """One random (often malformed) batch through build + init_forward_metadata + the op: a named error with the
    cache unchanged, or the float64 reference's result. Returns what happened."""
    s = make(backend, page_size=b["page_size"], kv_cache_tokens=48, max_context=16)
    gen = torch.Generator().manual_seed(b["seed"])
    fill_pool(s.kv, gen)
    rows = [s.kv.alloc_request() for _ in b["prefix"]]
    s.kv.alloc_extend(rows, b["prefix"])
    loc = s.kv.alloc_extend(rows, b["extend"])
    args = _corrupt(b["corruption"], dict(req_pool_indices=rows, prefix_lens=b["prefix"], extend_lens=b["extend"],
                                          out_cache_loc=loc), b["which"], b["amount"], s.kv.pool.num_slots)
    t = sum(b["extend"])
    q, k, v = new_tokens(t, gen)
    if b["corruption"] == "q-heads":
        q = torch.randn(t, NUM_HEADS + 1, HEAD_DIM, generator=gen)
    elif b["corruption"] == "k-tokens":
        k = torch.randn(t + b["amount"], NUM_KV_HEADS, HEAD_DIM, generator=gen)
    before = snapshot(s.kv)
    try:
        fb = ForwardBatch.build(**args)
        out = run_op(s, fb, q, k, v, out=torch.full((t, NUM_HEADS, HEAD_DIM), float("nan")))
    except CompileAttnError:
        assert_unchanged(s.kv, before)
        return "refused"
    expected = reference(s, q, k, v, args["req_pool_indices"], args["prefix_lens"], args["extend_lens"])
    assert max_rel_error(out, expected) < 1e-4, f"accepted {b} but the output differs from the reference"
    return "ran"


@pytest.mark.parametrize("backend", [pytest.param("torch_native"), pytest.param("triton", marks=on_cpu_only)])
def test_every_corruption_is_refused_and_the_clean_batch_runs(backend: str) -> None:
    """The fuzz's corruptions one by one on a fixed two-request batch: each is refused, the clean one matches."""
    for kind in dict.fromkeys(CORRUPTIONS):
        b = dict(page_size=4, prefix=[3, 2], extend=[1, 2], corruption=kind, which=1, amount=1, seed=5)
        assert fuzz_one(backend, b) == ("ran" if kind == "none" else "refused"), kind


@settings(max_examples=40)
@given(b=batches())
def test_fuzz_torch_native(b: dict) -> None:
    event(fuzz_one("torch_native", b))


@on_cpu_only
@settings(max_examples=30)
@given(b=batches())
def test_fuzz_triton_interpreted(b: dict) -> None:
    event(fuzz_one("triton", b))


if __name__ == "__main__":  # the child process of test_triton_refuses_malformed_batches_without_crashing
    print(json.dumps(_issue_cases(sys.argv[1] if len(sys.argv) > 1 else "cpu")))
