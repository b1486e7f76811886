"""HybridBackend: prefill and decode served by different backends over one KV cache.

CPU: torch_native and Triton (interpreted) in both orders against the float64 reference on random mixed,
prefix and decode batches, with the routing observed on the real parts; a request prefilled by one part is
decoded by the other; names, errors and graph support. The GPU pairs (fa3 / flashinfer / triton) run through
tests/attention/test_conformance.py.
"""

from __future__ import annotations

import pytest
import torch
from tests.batch_factory import random_step
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.reference import max_rel_error, reference_attention

from compile_attn import (
    AttentionLayer,
    ForwardBatch,
    KVCache,
    UnknownBackendError,
    create_backend,
    forward_context,
)
from compile_attn.graph_mode import GraphMode
from compile_attn.attention.hybrid import HybridBackend

pytest.importorskip("triton")
# The CPU tests pair torch_native with Triton interpreted on CPU tensors; where CUDA is present Triton compiles
# and refuses a CPU cache, so they skip there (the gpu-marked tests below run the pairs on the GPU).
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreted Triton on the CPU; the GPU runs the "
                              "gpu-marked tests")

HEAD_DIM = 64


def _kv(num_kv_heads: int = 2, page_size: int = 1, device: str = "cpu", dtype: torch.dtype = torch.float32,
        head_dim: int = HEAD_DIM) -> KVCache:
    return KVCache(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, max_batch_size=8, max_context=96,
                   kv_cache_tokens=1024, page_size=page_size, dtype=dtype, device=device)


def _spy(backend: HybridBackend, calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Record which part's ``forward`` runs; the real part still computes."""
    for role in ("prefill", "decode"):
        part = getattr(backend, role)
        real = part.forward

        def forward(*args, _real=real, _role=role, **kwargs):
            calls.append(_role)
            return _real(*args, **kwargs)

        monkeypatch.setattr(part, "forward", forward)


def _attend(backend, step, layer: AttentionLayer) -> torch.Tensor:
    out = torch.full_like(step.q, float("nan"))
    backend.init_forward_metadata(step.batch)
    with forward_context(step.batch, backend):
        torch.ops.compile_attn.attention(step.q, step.k, step.v, out, 0)
    return out


@st.composite
def cases(draw: st.DrawFn) -> dict:
    bs = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["decode", "extend", "mixed"]))
    if kind == "decode":
        prefix, extend = draw(st.lists(st.integers(1, 40), min_size=bs, max_size=bs)), [1] * bs
    else:
        prefix = draw(st.lists(st.integers(0, 40), min_size=bs, max_size=bs))
        extend = draw(st.lists(st.integers(1, 12), min_size=bs, max_size=bs))
        if kind == "mixed":
            prefix, extend = prefix + [draw(st.integers(1, 30))], extend + [1]  # a decode request rides along
    return dict(kind=kind, prefix=prefix, extend=extend, group=draw(st.sampled_from([1, 4, 8])),
                page_size=draw(st.sampled_from([1, 16])), window=draw(st.sampled_from([None, 5])),
                order=draw(st.sampled_from(["torch_native+triton", "triton+torch_native"])),
                seed=draw(st.integers(0, 2**16)))


@CPU_ONLY
@settings(max_examples=12, deadline=None)
@given(cases())
def test_matches_float64_reference_and_routes_by_mode(case: dict) -> None:
    with pytest.MonkeyPatch.context() as mp:
        kv = _kv(page_size=case["page_size"])
        layer = AttentionLayer(0, 2 * case["group"], 2, HEAD_DIM, sliding_window=case["window"])
        backend = create_backend(case["order"], kv, [layer])
        calls: list[str] = []
        _spy(backend, calls, mp)
        step = random_step(kv, case["prefix"], case["extend"], layer.num_heads, torch.Generator().manual_seed(case["seed"]))
        out = _attend(backend, step, layer)
    expected = reference_attention(step.q, step.k, step.v, *kv.pool.get_kv(0), kv.req_to_token, step.rows,
                                   step.prefix_lens, step.extend_lens, scaling=layer.scaling,
                                   sliding_window=layer.sliding_window)
    assert not out.isnan().any()
    assert max_rel_error(out, expected) < 1e-4
    # one token per request with a prefix is a decode batch whatever the case was drawn as; mixed go to prefill
    assert calls == ["decode" if step.batch.forward_mode.is_decode() else "prefill"]
    torch.testing.assert_close(kv.pool.get_kv(0)[0][step.batch.out_cache_loc], step.k)


@CPU_ONLY
@pytest.mark.parametrize("order", ["torch_native+triton", "triton+torch_native"])
def test_a_request_prefilled_by_one_part_is_decoded_by_the_other(order: str) -> None:
    kv = _kv(page_size=4)
    layer = AttentionLayer(0, 8, 2, HEAD_DIM)
    backend = create_backend(order, kv, [layer])
    gen = torch.Generator().manual_seed(0)
    rows, lens = [kv.alloc_request(), kv.alloc_request()], [13, 6]
    history_k = []
    for step_no in range(4):
        extend = lens if step_no == 0 else [1, 1]
        prefix = [0, 0] if step_no == 0 else [lens[0] + step_no - 1, lens[1] + step_no - 1]
        fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=prefix, extend_lens=extend,
                                out_cache_loc=kv.alloc_extend(rows, extend))
        t = sum(extend)
        q, k, v = (torch.randn(t, h, HEAD_DIM, generator=gen) for h in (8, 2, 2))
        out = torch.empty_like(q)
        backend.init_forward_metadata(fb)
        with forward_context(fb, backend):
            torch.ops.compile_attn.attention(q, k, v, out, 0)
        history_k.append(k)
        expected = reference_attention(q, k, v, *kv.pool.get_kv(0), kv.req_to_token, rows, prefix, extend,
                                       scaling=layer.scaling)
        assert max_rel_error(out, expected) < 1e-4, f"step {step_no}"
    # the pool holds exactly the K that the steps produced, in request order
    k_all = kv.pool.get_kv(0)[0]
    for i, row in enumerate(rows):
        written = k_all[kv.req_to_token[row, : lens[i] + 3].long()]
        first = history_k[0][sum(lens[:i]) : sum(lens[: i + 1])]
        produced = torch.cat([first] + [h[i : i + 1] for h in history_k[1:]])
        torch.testing.assert_close(written, produced)


@CPU_ONLY
def test_names_graph_support_and_errors() -> None:
    kv, layers = _kv(), [AttentionLayer(0, 4, 2, HEAD_DIM)]
    backend = create_backend("torch_native+torch_native", kv, layers)
    assert isinstance(backend, HybridBackend) and backend.name == "torch_native+torch_native"
    assert backend.prefill is not backend.decode
    assert backend.supported_graph_mode() is GraphMode.FULL_AND_PIECEWISE
    # interpreted Triton supports piecewise only: as the decode part it rules out full decode graphs
    assert create_backend("torch_native+triton", kv, layers).supported_graph_mode() is GraphMode.PIECEWISE
    assert create_backend("triton+torch_native", kv, layers).supported_graph_mode() is GraphMode.FULL_AND_PIECEWISE
    built = create_backend("torch_native", kv, layers)
    assert HybridBackend(kv, layers, prefill=built, decode="torch_native").prefill is built
    with pytest.raises(UnknownBackendError, match="'<prefill>\\+<decode>'"):
        create_backend("torch_native+", kv, layers)
    with pytest.raises(UnknownBackendError, match="unknown attention backend 'nope'"):
        create_backend("nope+torch_native", kv, layers)
    with pytest.raises(ValueError, match="different KVCache"):
        HybridBackend(kv, layers, prefill=create_backend("torch_native", _kv(), layers), decode="torch_native")
    with pytest.raises(ValueError, match="single backend name"):
        HybridBackend(kv, layers, prefill="hybrid", decode="torch_native")


@CPU_ONLY
def test_graph_state_goes_to_the_captured_part_only() -> None:
    kv, layers = _kv(), [AttentionLayer(0, 4, 2, HEAD_DIM)]
    backend = create_backend("triton+torch_native", kv, layers)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=16)
    assert backend.decode._cg_table.shape[0] == 4  # torch_native's static decode buffers exist
    assert backend.prefill.graph_buffers is None  # Triton prefill runs eagerly between pieces: none allocated
