"""Triton attention kernels over a token-level paged KV cache: pure functions of torch tensors.

``kv_index`` builds the token CSR (and a page CSR's ids) from ``req_to_token`` and stores new K/V, ``decode_attention``
runs split-K paged decode (CUDA-graph capturable), ``decode_metadata`` builds a decode step's CSR and
split counts in one launch, ``extend_attention`` runs prefill/extend over a cached prefix. Nothing here
depends on the rest of compile_attn but the ``env`` switches; the triton
backend wraps these, and the flashinfer backend gathers its page ids with ``build_page_indices``. Loaded through
``attention/kernel_loader.py``.
On CPU the kernels run only under ``TRITON_INTERPRET=1`` (tests).
"""

from compile_attn.attention.kernels._common import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, check_supported
from compile_attn.attention.kernels.decode_attention import (
    DEFAULT_MAX_KV_SPLITS,
    DEFAULT_SPLIT_SIZE,
    FP8_PROGRAMS_PER_SM,
    PROGRAMS_PER_SM,
    compute_num_kv_splits,
    decode_attention_fwd,
    decode_attention_fwd_and_bind,
    decode_semaphores,
)
from compile_attn.attention.kernels.decode_metadata import build_decode_metadata
from compile_attn.attention.kernels.extend_attention import build_mask_indptr, extend_attention_fwd
from compile_attn.attention.kernels.kv_index import build_kv_indices, build_kv_indptr, build_page_indices, store_kv

__all__ = [
    "DEFAULT_MAX_KV_SPLITS",
    "DEFAULT_SPLIT_SIZE",
    "FP8_PROGRAMS_PER_SM",
    "PROGRAMS_PER_SM",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "build_decode_metadata",
    "build_kv_indices",
    "build_kv_indptr",
    "build_mask_indptr",
    "build_page_indices",
    "check_supported",
    "compute_num_kv_splits",
    "decode_attention_fwd",
    "decode_attention_fwd_and_bind",
    "decode_semaphores",
    "extend_attention_fwd",
    "store_kv",
]
