"""FlashInfer's two-level cascade for shared-prefix decode: the page tables it is planned with (CPU: the pages of
each request's two levels, expanded to slots, are exactly its ``req_to_token`` row), and on a GPU with flashinfer
its output against a float64 reference of plain attention, and the flashinfer backend's decode through it against
the torch_native backend."""

from __future__ import annotations

import pytest
import torch
from tests.attention.kernels.kernel_reference import DEVICE, TOLERANCE, rel_err
from tests.attention.kernels.test_cascade_attention import make_shared_cache, reference
from tests.attention.triton.test_cascade_backend import D, HKV, HQ, decode_step, shared_cache

from compile_attn.attention.flashinfer.cascade import cascade_pages
from compile_attn.attention.flashinfer.library import flashinfer_installed
from compile_attn.kv.shared_prefix import SharedPrefixFinder


def slots_of(pages: torch.Tensor, last_page_len: int, page_size: int) -> list[int]:
    if not len(pages):
        return []
    slots = (pages.long()[:, None] * page_size + torch.arange(page_size, device=pages.device)).flatten()
    return slots[: (len(pages) - 1) * page_size + last_page_len].tolist()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("with_rest", [False, True])
def test_cascade_pages_cover_each_request_once(page_size, with_rest):
    gen = torch.Generator().manual_seed(page_size)
    groups = [([3, 0], 4 * page_size), ([1, 4, 2], 2 * page_size)]
    own = [3, 9, 1, 5, 2] + ([7] if with_rest else [])
    _, _, table, rows, seq_lens = make_shared_cache(groups, own, 1, 8, page_size, torch.float32, gen)
    pages = cascade_pages(table, rows.tolist(), seq_lens, groups, page_size)
    assert sorted(pages.order) == list(range(len(own)))
    qo0, ind0, last0 = (t.tolist() for t in (pages.qo_indptr[0], pages.kv_indptr[0], pages.last_page_len[0]))
    ind1, last1 = pages.kv_indptr[1].tolist(), pages.last_page_len[1].tolist()
    for i, b in enumerate(pages.order):
        seg = max(s for s in range(len(qo0) - 1) if qo0[s] <= i)  # the level-0 segment holding row i
        shared = slots_of(pages.kv_indices[0][ind0[seg]:ind0[seg + 1]], last0[seg], page_size)
        mine = slots_of(pages.kv_indices[1][ind1[i]:ind1[i + 1]], last1[i], page_size)
        assert shared + mine == table[int(rows[b]), :seq_lens[b]].tolist()


def test_cascade_pages_refuse_a_prefix_inside_a_page():
    gen = torch.Generator().manual_seed(0)
    _, _, table, rows, seq_lens = make_shared_cache([([0, 1], 6)], [2, 2], 1, 8, 4, torch.float32, gen)
    with pytest.raises(ValueError, match="not a multiple of the page size 4"):
        cascade_pages(table, rows.tolist(), seq_lens, [([0, 1], 6)], 4)


@pytest.mark.gpu
@pytest.mark.skipif(not flashinfer_installed(), reason="flashinfer is not installed")
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_cascade_matches_plain_attention(page_size):
    from compile_attn.attention.flashinfer.cascade import FlashInferCascadeDecode

    gen = torch.Generator().manual_seed(0)
    own = [1 + (37 * b) % 300 for b in range(40)]
    groups = [(list(range(0, 40, 2)), 1024), ([1, 3, 5, 7], 96)]  # the odd requests from 9 on share nothing
    hq, hkv, d = 32, 8, 64
    k, v, table, rows, seq_lens = make_shared_cache(groups, own, hkv, d, page_size, torch.bfloat16, gen)
    q = torch.randn(len(own), hq, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    cascade = FlashInferCascadeDecode(torch.empty(128 << 20, dtype=torch.uint8, device=DEVICE))
    cascade.plan(table, rows.tolist(), seq_lens, groups, page_size=page_size, num_qo_heads=hq, num_kv_heads=hkv,
                 head_dim=d, sm_scale=d ** -0.5)
    out = torch.full_like(q, float("nan"))
    cascade.run(q, k, v, out)
    assert rel_err(out, reference(q, k, v, table, rows, seq_lens, d ** -0.5)) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(not flashinfer_installed(), reason="flashinfer is not installed")
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_backend_decodes_shared_prefixes_through_the_cascade(page_size):
    from compile_attn.attention.flashinfer.backend import FlashInferBackend
    from compile_attn.attention.torch_native.backend import TorchNativeBackend
    from compile_attn.layer import AttentionLayer

    gen = torch.Generator().manual_seed(page_size)
    kv, rows, lens, borrowed = shared_cache(page_size, 200, [3, 1, 6, 2, 30], gen, device=DEVICE, dtype=torch.bfloat16)
    assert borrowed[1:] == [200 // page_size * page_size] * 4
    layers = [AttentionLayer(layer_id=i, num_heads=HQ, num_kv_heads=HKV, head_dim=D) for i in range(2)]
    backend = FlashInferBackend(kv, layers)
    reference_backend = TorchNativeBackend(kv, layers)
    fb = decode_step(kv, rows, lens)
    fb.shared_prefix = SharedPrefixFinder(kv, min_requests=2, min_tokens=8).groups_for(fb)
    backend.init_forward_metadata(fb)
    assert backend.cascade_steps == 1
    n = len(rows)
    for layer in layers:
        q = torch.randn(n, HQ, D, generator=gen).to(torch.bfloat16).to(DEVICE)
        k = torch.randn(n, HKV, D, generator=gen).to(torch.bfloat16).to(DEVICE)
        v = torch.randn(n, HKV, D, generator=gen).to(torch.bfloat16).to(DEVICE)
        out, ref = torch.full_like(q, float("nan")), torch.empty_like(q)
        backend.forward(q, k, v, layer, fb, out)
        reference_backend.init_forward_metadata(fb)
        reference_backend.forward(q, k, v, layer, fb, ref)
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
