"""Metadata preparation of the triton backend: where a decode step's token CSRs and split-K scratch live, and an
extend step's offsets (with draft trees' masks and positions).

``DecodeBuffers`` owns the static decode buffers that graphs read (``init_cuda_graph_state``) and an eager decode's
own CSRs and grow-only scratch; ``prepare_extend`` builds an extend step from host lengths (over the requests after
a mixed batch's leading decode rows where those have a decode step of their own, ``mixed.py``). The backend
(``backend.py``) decides which step a batch gets and fills a decode step's CSR on the device; nothing here launches
attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from types import ModuleType

import numpy as np
import torch

from compile_attn.attention.triton.metadata import (
    DecodeGraphBuffers,
    DecodeIndex,
    DecodeStep,
    ExtendStep,
    SplitScratch,
    TreeMask,
)
from compile_attn.batch import ForwardBatch
from compile_attn.draft_tree import ancestor_masks, has_tree, tree_positions
from compile_attn.host_tensors import to_device
from compile_attn.kv.cache import KVCache


def _exclusive_cumsum(lens: Sequence[int]) -> list[int]:
    """Host ``[len(lens) + 1]`` offsets."""
    return [0, *accumulate(lens)]


class DecodeBuffers:
    """A decode step's token CSRs (one per sliding window) and split-K scratch (one per head shape): the static set
    graphs read, or for an eager decode its own CSRs and a grow-only scratch set."""

    def __init__(self, device: torch.device, windows: list[int | None], head_shapes: list[tuple[int, int]],
                 max_kv_splits: int, graph_max_context: int) -> None:
        self.device, self.windows, self.head_shapes = device, windows, head_shapes
        self.max_kv_splits, self.graph_max_context = max_kv_splits, graph_max_context
        self.graph: DecodeGraphBuffers | None = None
        self._eager_scratch: dict[tuple[int, int], SplitScratch] = {}

    def allocate_graph(self, max_bs: int) -> bool:
        """Allocate the static buffers for up to ``max_bs`` requests; False (nothing replaced) if those there fit."""
        if self.graph is not None and self.graph.max_bs >= max_bs:
            return False  # graphs captured so far keep their buffers
        indexes = {
            w: DecodeIndex.allocate(w, max_bs, max_bs * self.index_capacity(w), self.device, zero=True)
            for w in self.windows
        }
        scratch = {
            shape: SplitScratch.allocate(max_bs, *shape, self.max_kv_splits, self.device) for shape in self.head_shapes
        }
        tree_mask = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        self.graph = DecodeGraphBuffers(max_bs, indexes, scratch, tree_mask)
        return True

    def index_capacity(self, window: int | None) -> int:
        """Most KV tokens one request reads in a decode graph."""
        return self.graph_max_context if window is None else min(window, self.graph_max_context)

    def bind_graph(self, bs: int) -> DecodeStep:
        """A decode step of ``bs`` requests over the static buffers (the caller checked the graph view)."""
        graph = self.graph
        assert graph is not None
        return DecodeStep(bs, graph.head(bs), graph.scratch, graph_bound=True)

    def allocate_eager(self, fb: ForwardBatch) -> DecodeStep:
        """An eager decode step with CSRs sized for ``fb``'s host sequence lengths."""
        return self.allocate_rows(fb.batch_size, fb.seq_lens_cpu)

    def allocate_rows(self, bs: int, lens: torch.Tensor) -> DecodeStep:
        """An eager decode step of ``bs`` requests with CSRs sized for their host sequence lengths ``lens``."""
        indexes = {
            w: DecodeIndex.allocate(w, bs, int(lens.sum() if w is None else lens.clamp(max=w).sum()), self.device,
                                    zero=False)
            for w in self.windows
        }
        return DecodeStep(bs, indexes, self.scratch_for(bs))

    def scratch_for(self, bs: int) -> dict[tuple[int, int], SplitScratch]:
        """Scratch for an eager decode of ``bs`` requests: the graph's if it fits, else a grow-only set."""
        if self.graph is not None and self.graph.max_bs >= bs:
            return self.graph.scratch
        if not self._eager_scratch or next(iter(self._eager_scratch.values())).capacity < bs:
            self._eager_scratch = {
                shape: SplitScratch.allocate(bs, *shape, self.max_kv_splits, self.device) for shape in self.head_shapes
            }
        return self._eager_scratch


def prepare_extend(fb: ForwardBatch, ops: ModuleType, kv_cache: KVCache, device: torch.device,
                   decode: DecodeStep | None = None) -> ExtendStep:
    """An extend step's query/prefix offsets and prefix KV indices (draft trees' masks and positions ride in the
    offsets' one host-to-device copy). With ``decode`` (the decode step of the batch's leading decode rows,
    ``triton/mixed.py``) the offsets cover the requests after those rows only."""
    d = 0 if decode is None else decode.batch_size
    if d and has_tree(fb.draft_parents):
        raise ValueError("a batch with draft trees runs every row in the extend kernel: no decode rows split off")
    ext, prefix = fb.extend_seq_lens_cpu[d:], fb.extend_prefix_lens_cpu[d:]
    qo_cpu, kv_cpu = _exclusive_cumsum(ext), _exclusive_cumsum(prefix)
    tree = None
    if has_tree(fb.draft_parents):  # the trees' masks and positions ride in the offsets' copy
        mask, mask_offsets = ancestor_masks(fb.draft_parents)
        words = np.frombuffer(mask.tobytes() + bytes(-mask.size % 4), dtype=np.int32)  # uint8 as int32 words
        qo_indptr, kv_indptr, mask_indptr, positions, mask_words = to_device(
            [qo_cpu, kv_cpu, mask_offsets, tree_positions(prefix, fb.draft_parents), words], torch.int32, device)
        tree = TreeMask(mask_words.view(torch.uint8)[: mask.size], mask_indptr, positions)
    else:
        qo_indptr, kv_indptr = to_device([qo_cpu, kv_cpu], torch.int32, device)  # one copy
    total_prefix = kv_cpu[-1]
    kv_indices = torch.empty(max(total_prefix, 1), dtype=torch.int32, device=device)
    if total_prefix:
        rows, prefix_lens = fb.req_pool_indices, fb.extend_prefix_lens
        if d:
            rows, prefix_lens = rows[d:], prefix_lens[d:]
        ops.build_kv_indices(kv_cache.req_to_token, rows, prefix_lens, kv_indptr, kv_indices)
    return ExtendStep(
        num_tokens=d + qo_cpu[-1], qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
        max_len_extend=max(ext, default=0), draft_parents=fb.draft_parents, tree=tree, decode=decode,
    )
