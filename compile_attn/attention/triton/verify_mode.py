"""Chain verify steps in the triton decode kernel's verify mode (``decode_attention_fwd(..., tokens_per_request=Q)``).

A chain verify batch whose requests all verify the same Q tokens (``ForwardBatch.chain_verify_tokens``) is decode of
its B requests with Q query rows each: the token CSR, built like decode's (``build_decode_metadata``) over the B
requests with ``seq_len = prefix + Q``, and split counts by decode's policy; the scratch is per query row (B x Q).
The new K/V are stored first, then one launch per layer reads each request's prefix once for its Q tokens (token t
sees the first ``seq_len - Q + 1 + t`` keys). Run eagerly (or between piecewise graphs) the CSR is allocated per step;
in a graph runner's verify view (``fb.graph_bucket`` set, padded requests on row ``PAD_REQUEST`` with seq_len 1) it
uses the static decode buffers, so the step can be one full CUDA graph. Layers with a sliding window take the extend
route (a token's window would start at its own position, which one CSR per request cannot say).

A draft tree verify batch whose requests all verify Q tokens (``ForwardBatch.draft_parents`` set,
``uniform_verify_tokens``) runs the same way with the kernel's tree mask: each query row's ancestors and itself among
its request's Q new keys as the bits of one int64 word (``draft_tree.ancestor_bits``), built on the host from the
parents and copied to the device out of graph (into the static ``DecodeGraphBuffers.tree_mask`` in a verify view, so
a captured tree verify graph reads each step's trees). The tokens' positions (``prefix + depth``) are the batch's own
``positions``. Requests of a view without parents (padded ones) take a chain's bits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from compile_attn.attention.kernels.decode_checks import MAX_VERIFY_ROWS
from compile_attn.attention.triton.launch import kv_scale_args, last_dim_contiguous
from compile_attn.attention.triton.metadata import DecodeGraphBuffers, DecodeIndex, SplitScratch
from compile_attn.batch import ForwardBatch
from compile_attn.draft_tree import ancestor_bits, chain
from compile_attn.host_tensors import int_tensor, upload, upload_into
from compile_attn.env import verify_mode
from compile_attn.kv.cache import KVCache
from compile_attn.layer import AttentionLayer


@dataclass
class VerifyStep:
    """Metadata of one verify step in verify mode (chains, or draft trees with ``tree_mask``): ``batch_size`` requests
    (a view's padded ones included) of ``tokens_per_request`` tokens, their token CSR and the per-row split scratch."""

    batch_size: int
    tokens_per_request: int
    index: DecodeIndex
    scratch: dict[tuple[int, int], SplitScratch]
    graph_bound: bool = False
    filled: bool = False  # set by fill (init_forward_metadata_in_graph)
    tree_mask: torch.Tensor | None = None  # a tree verify step's ancestor bits per query row (int64); None: chains

    @property
    def num_rows(self) -> int:
        return self.batch_size * self.tokens_per_request


def uniform_verify_tokens(fb: ForwardBatch) -> int | None:
    """Q when ``fb`` is a verify batch whose requests all verify the same Q tokens, chains or draft trees (host lists
    only), else None."""
    if not fb.forward_mode.is_verify() or not fb.batch_size:
        return None
    lens = fb.extend_seq_lens_cpu
    q = lens[0]
    return q if q > 0 and lens.count(q) == len(lens) else None


def tree_mask_words(draft_parents: tuple[tuple[int, ...], ...], batch_size: int, q: int) -> torch.Tensor:
    """The host int64 ``[batch_size * q]`` ancestor bits of a tree verify step's query rows; requests past
    ``draft_parents`` (a view's padded ones) take a chain's."""
    padding = ancestor_bits(chain(q))
    words = [w for parents in draft_parents for w in ancestor_bits(parents)]
    words.extend(padding * (batch_size - len(draft_parents)))
    return int_tensor(words)


class VerifyPlanner:
    """Prepares, fills and runs ``VerifyStep``s for the triton backend. ``steps`` counts the verify steps prepared
    (tests, debugging). ``split_options``: the decode split policy's keywords of ``build_decode_metadata``."""

    def __init__(self, kv_cache: KVCache, ops: ModuleType, layers: list[AttentionLayer],
                 split_options: dict, one_launch: bool, deterministic: bool) -> None:
        self.kv_cache, self.ops = kv_cache, ops
        self.split_options, self.one_launch, self.deterministic = split_options, one_launch, deterministic
        self.full_attention = all(layer.sliding_window is None for layer in layers)
        self.max_group = max(layer.num_heads // layer.num_kv_heads for layer in layers)
        self.enabled = verify_mode()  # COMPILE_ATTN_VERIFY_MODE=0 switches it off
        self.steps = 0
        self.tree_steps = 0  # of them, with draft trees (a tree mask)

    def supports(self, tokens_per_request: int) -> bool:
        """Switched on (``env.verify_mode``), every layer attends to the whole sequence and one program takes a
        request's Q tokens x the GQA group."""
        return (self.enabled and self.full_attention and 1 <= tokens_per_request
                and tokens_per_request * self.max_group <= MAX_VERIFY_ROWS)

    def prepare(self, fb: ForwardBatch, tokens_per_request: int, graph: DecodeGraphBuffers | None,
                scratch_for: Callable[[int], dict[tuple[int, int], SplitScratch]]) -> VerifyStep:
        """The verify step of ``fb`` (a verify batch of ``tokens_per_request`` tokens per request that ``supports``;
        with ``draft_parents``, their tree mask uploaded now): bound to ``graph``'s static decode buffers and tree mask
        where given (a graph runner's verify view), else with a CSR of its own and ``scratch_for(rows)`` (eager, or
        between piecewise graphs: then trailing padding tokens may follow the B x Q)."""
        bs, q = fb.batch_size, tokens_per_request
        words = None if fb.draft_parents is None else tree_mask_words(fb.draft_parents, bs, q)
        if graph is not None:
            mask = None
            if words is not None:
                mask = graph.tree_mask[: bs * q]
                upload_into(mask, words)
            step = VerifyStep(bs, q, graph.head(bs)[None], graph.scratch, graph_bound=True, tree_mask=mask)
        else:
            index = DecodeIndex.allocate(None, bs, int(fb.seq_lens_cpu[:bs].sum()), self.kv_cache.device, zero=False)
            mask = None if words is None else upload(words, self.kv_cache.device)
            step = VerifyStep(bs, q, index, scratch_for(bs * q), tree_mask=mask)
        self.steps += 1
        self.tree_steps += words is not None
        return step

    def fill(self, step: VerifyStep, fb: ForwardBatch, num_kv_heads: int) -> None:
        """The token CSR and split counts of the step's requests on the device (graph-recordable)."""
        idx = step.index
        self.ops.build_decode_metadata(
            self.kv_cache.req_to_token, fb.req_pool_indices[: step.batch_size], fb.seq_lens[: step.batch_size],
            idx.kv_indptr, idx.kv_indices, idx.num_kv_splits, num_kv_heads=num_kv_heads, window=None, kv_start=None,
            **self.split_options,
        )
        step.filled = True

    def forward(self, step: VerifyStep, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                fb: ForwardBatch, out: torch.Tensor, save_kv_cache: bool, max_kv_splits: int) -> None:
        """Store the step's K/V (``save_kv_cache``; padding tokens write the scratch slot), then verify-mode attention
        of its ``B x Q`` rows into ``out`` (trailing padding tokens' rows zeroed)."""
        k_buf, v_buf = self.kv_cache.pool.get_kv(layer.layer_id)
        kw = kv_scale_args(self.kv_cache, layer.layer_id)
        if save_kv_cache:
            self.ops.store_kv(k_buf, v_buf, fb.out_cache_loc, last_dim_contiguous(k), last_dim_contiguous(v), **kw)
        n = step.num_rows
        scratch = step.scratch[(layer.num_heads, layer.v_head_dim)]
        target = out[:n] if out.stride(-1) == 1 else torch.empty_like(out[:n])
        idx = step.index
        self.ops.decode_attention_fwd(
            last_dim_contiguous(q[:n]), k_buf, v_buf, target, idx.kv_indptr, idx.kv_indices, idx.num_kv_splits,
            max_kv_splits, scratch.attn_logits, scratch.attn_lse, layer.scaling, layer.logit_cap,
            semaphores=scratch.semaphores if self.one_launch else None, batch_invariant=self.deterministic,
            tokens_per_request=step.tokens_per_request, tree_mask=step.tree_mask, **kw,
        )
        if target.data_ptr() != out.data_ptr():
            out[:n].copy_(target)
        if out.shape[0] > n:
            out[n:].zero_()
