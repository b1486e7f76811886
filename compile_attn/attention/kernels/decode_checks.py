"""Argument checks of :func:`decode_attention.decode_attention_fwd`: shapes, scratch, the fused new-token store's
tensors, the one-launch counters, the verify mode's tokens per request and a draft tree's mask.

Each error names the bad value and what was expected. Shapes, dtypes and devices only: no host sync, nothing
launched (the checks run on the host's critical path, once per layer per step).
"""

from __future__ import annotations

import torch

# Rows of one stage-1 program in the verify mode (tokens per request x the GQA group): its tile's rows.
MAX_VERIFY_ROWS = 64


def check_decode_shapes(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, out: torch.Tensor, attn_logits: torch.Tensor,
    attn_lse: torch.Tensor, max_kv_splits: int, tokens_per_request: int,
) -> int:
    """The number of requests (``q``'s rows / ``tokens_per_request``) after checking the shapes against each other."""
    rows, num_q_heads, head_dim = q.shape
    _, num_kv_heads, k_dim = k_buffer.shape
    v_head_dim = v_buffer.shape[-1]
    if k_dim != head_dim or v_buffer.shape[1] != num_kv_heads:
        raise ValueError(
            f"k_buffer {tuple(k_buffer.shape)} / v_buffer {tuple(v_buffer.shape)} do not match q {tuple(q.shape)}"
        )
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if tokens_per_request != 1:
        check_tokens_per_request(tokens_per_request, rows, num_q_heads // num_kv_heads)
    if tuple(out.shape) != (rows, num_q_heads, v_head_dim):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(rows, num_q_heads, v_head_dim)}")
    if (
        attn_logits.shape[0] < rows
        or attn_logits.shape[1] != num_q_heads
        or attn_logits.shape[2] < max_kv_splits
        or attn_logits.shape[3] != v_head_dim
        or attn_lse.shape[0] < rows
        or attn_lse.shape[2] < max_kv_splits
    ):
        raise ValueError(
            f"attn_logits {tuple(attn_logits.shape)} / attn_lse {tuple(attn_lse.shape)} are too small for "
            f"{rows} query rows, {num_q_heads} heads, max_kv_splits {max_kv_splits}, v_head_dim {v_head_dim}"
        )
    return rows // tokens_per_request


def check_tokens_per_request(tokens_per_request: int, rows: int, group: int) -> None:
    """The verify mode: ``rows`` query rows of ``tokens_per_request`` tokens each, and one program's rows
    (tokens x ``group``) within ``MAX_VERIFY_ROWS``."""
    if tokens_per_request < 1:
        raise ValueError(f"tokens_per_request must be >= 1, got {tokens_per_request}")
    if rows % tokens_per_request:
        raise ValueError(f"q has {rows} rows, not a multiple of tokens_per_request {tokens_per_request} (each "
                         "request's tokens are consecutive rows)")
    if tokens_per_request * group > MAX_VERIFY_ROWS:
        raise ValueError(
            f"tokens_per_request {tokens_per_request} x GQA group {group} = {tokens_per_request * group} query rows "
            f"per KV head, more than one program takes ({MAX_VERIFY_ROWS}); verify fewer tokens per request, or run "
            "them as decode rows (tokens_per_request=1, one row per token with its own seq_len)"
        )


def check_new_tokens(
    k_new: torch.Tensor | None, v_new: torch.Tensor | None, new_loc: torch.Tensor | None, bs: int,
    num_kv_heads: int, head_dim: int, v_head_dim: int, tokens_per_request: int,
) -> None:
    """The fused store's tensors (decode only: one new token per request)."""
    if tokens_per_request != 1:
        raise ValueError(
            f"k_new/v_new/new_loc (the fused new-token store) are decode only; with tokens_per_request "
            f"{tokens_per_request} every request's tokens must already be in the cache: store them first (store_kv)"
        )
    if k_new is None or v_new is None:
        raise ValueError("the fused K/V store needs both k_new and v_new (new_loc alone has nothing to store)")
    ks, vs = k_new.shape, v_new.shape  # torch.Size compares equal to plain tuples
    if len(ks) != 3 or ks[0] < bs or ks[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"k_new has shape {tuple(ks)}, expected (>= {bs}, {num_kv_heads}, {head_dim})")
    if len(vs) != 3 or vs[0] < bs or vs[1:] != (num_kv_heads, v_head_dim):
        raise ValueError(f"v_new has shape {tuple(vs)}, expected (>= {bs}, {num_kv_heads}, {v_head_dim})")
    if new_loc is not None and (new_loc.dim() != 1 or new_loc.shape[0] < bs):
        raise ValueError(f"new_loc has shape {tuple(new_loc.shape)}, expected one slot per request (>= {bs})")


def check_semaphores(semaphores: torch.Tensor, rows: int, num_q_heads: int, device: torch.device) -> None:
    """One-launch counters: int32 ``[>= rows, >= num_q_heads]`` (``rows``: query rows), row-contiguous."""
    shape = tuple(semaphores.shape)
    if semaphores.dtype != torch.int32 or len(shape) != 2 or shape[0] < rows or shape[1] < num_q_heads:
        raise ValueError(
            f"semaphores must be int32 of shape (>= {rows}, >= {num_q_heads}) (see decode_semaphores), got "
            f"{semaphores.dtype} {shape}"
        )
    if semaphores.stride(1) != 1 or semaphores.device != device:
        raise ValueError(f"semaphores must be row-contiguous on {device}, got strides {semaphores.stride()} on "
                         f"{semaphores.device}")


def check_tree_mask(tree_mask: torch.Tensor, rows: int, device: torch.device) -> None:
    """A tree verify step's ancestor bits: int64 ``[>= rows]`` (one word per query row), contiguous, on ``device``."""
    if tree_mask.dtype != torch.int64 or tree_mask.dim() != 1 or tree_mask.shape[0] < rows:
        raise ValueError(
            f"tree_mask must be int64 of shape (>= {rows},) (one ancestor bitmask per query row, see "
            f"draft_tree.ancestor_bits), got {tree_mask.dtype} {tuple(tree_mask.shape)}"
        )
    if tree_mask.stride(0) != 1 or tree_mask.device != device:
        raise ValueError(f"tree_mask must be contiguous on {device}, got stride {tree_mask.stride()} on "
                         f"{tree_mask.device}")
