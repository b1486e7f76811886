"""CPU tests of the flashinfer backend: import hygiene, the clear error without flashinfer, and the page
CSR it builds. Attention itself is only tested against the real kernels (tests/attention/flashinfer/test_flashinfer_gpu.py):
no stand-in replaces FlashInfer here."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from compile_attn import AttentionLayer, BackendUnavailableError, KVCache, create_backend
from compile_attn.attention.flashinfer.library import flashinfer_installed
from compile_attn.attention.flashinfer.paged_indices import build_paged_kv, page_csr


def _small_kv(**kw) -> KVCache:  # noqa: ANN003
    args = dict(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=4, max_context=64, kv_cache_tokens=256,
                dtype=torch.bfloat16)
    return KVCache(**(args | kw))


# ------------------------------------------------------------------ without flashinfer
def test_import_compile_attn_does_not_import_flashinfer() -> None:
    code = ("import sys, compile_attn, compile_attn.attention.flashinfer.backend; "
            "assert 'flashinfer' not in sys.modules, 'flashinfer was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.skipif(flashinfer_installed(), reason="flashinfer is installed here")
def test_missing_flashinfer_is_a_clear_error() -> None:
    with pytest.raises(BackendUnavailableError, match=r'pip install "compile-attn\[flashinfer\]"'):
        create_backend("flashinfer", _small_kv(), [AttentionLayer(0, 8, 2, 64)])


def test_broken_flashinfer_import_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` raise ImportError
    with pytest.raises(BackendUnavailableError, match=r'pip install "compile-attn\[flashinfer\]"'):
        create_backend("flashinfer", _small_kv(), [AttentionLayer(0, 8, 2, 64)])


# ------------------------------------------------------------------ configuration errors
# ------------------------------------------------------------------ page CSR
def test_page_csr_packs_indptr_and_last_page_lengths_for_one_upload() -> None:
    csr = page_csr([5, 0, 16, 1], 4)
    assert csr.indptr.tolist() == [0, 2, 2, 6, 7]  # pages per request: 2, 0, 4, 1
    assert csr.last_page_len.tolist() == [1, 0, 4, 1]
    assert csr.packed.tolist() == csr.indptr.tolist() + csr.last_page_len.tolist()
    assert csr.total_pages == 7 and csr.batch_size == 4
    with pytest.raises(ValueError, match=r"\[3, -1\]"):
        page_csr([3, -1], 4)
    with pytest.raises(OverflowError):
        page_csr([2**30, 2**30], 1)


def test_page_csr_rows_and_lengths_must_agree() -> None:
    kv = _small_kv()
    with pytest.raises(ValueError, match="2 request rows but 3 lengths"):
        build_paged_kv(kv.req_to_token, torch.tensor([0, 1]), [1, 2, 3], 1)


@pytest.mark.parametrize("page_size", [1, 4])
def test_page_csr_lists_each_requests_pages_in_order(page_size: int) -> None:
    # the gather is a Triton kernel: interpreted on the CPU without CUDA, compiled on a GPU machine
    kv = _small_kv(page_size=page_size, kv_cache_tokens=512, device="cuda" if torch.cuda.is_available() else "cpu")
    rows = [kv.alloc_request() for _ in range(3)]
    lens = [9, 0, 5]
    kv.alloc_extend(rows, lens)
    csr = build_paged_kv(kv.req_to_token, torch.tensor(rows, device=kv.device), lens, page_size)
    for b, (row, n) in enumerate(zip(rows, lens)):
        pages = csr.indices[csr.indptr_cpu[b] : csr.indptr_cpu[b + 1]].tolist()
        num_pages = -(-n // page_size)
        assert pages == [int(kv.req_to_token[row, j * page_size]) // page_size for j in range(num_pages)]
        assert all(int(kv.req_to_token[row, j]) // page_size == pages[j // page_size] for j in range(n))
        assert int(csr.last_page_len_cpu[b]) == (n - (len(pages) - 1) * page_size if n else 0)
