"""hybrid: one backend for prefill (EXTEND and MIXED batches), another for decode, over one KV cache.

``HybridBackend(kv, layers, prefill="fa3", decode="flashinfer")``, or by name: ``create_backend("fa3+flashinfer",
...)`` / ``LLM(model, attn_backend="fa3+flashinfer")`` (prefill first, then decode). Both parts read and write
the same paged pool, so a request prefilled by one is decoded by the other. Every contract call is routed by
the batch's forward mode; mixed batches (prefill and decode requests together) and verification steps (chains or
draft trees of drafts) go to the prefill backend, which decides whether the pair verifies trees.

Graphs: decode graphs are captured through the decode backend, so its graph support decides whether decode
runs as one full graph; extend runs piecewise (attention eager between pieces) through the prefill backend.
``init_cuda_graph_state`` allocates static buffers only for the part whose attention is recorded in graphs: the
decode backend, when it can run in full decode graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from compile_attn.attention.base import AttentionBackend
from compile_attn.attention.registry import create_backend, register_backend
from compile_attn.batch import ForwardBatch
from compile_attn.graph_mode import GraphMode
from compile_attn.kv.cache import KVCache
from compile_attn.layer import AttentionLayer

logger = logging.getLogger(__name__)


def hybrid_graph_support(prefill: GraphMode, decode: GraphMode) -> GraphMode:
    """What the pair runs in: no graphs if either part allows none; full decode graphs if the decode part allows
    them; else piecewise (extend is piecewise whatever the prefill part declares)."""
    if GraphMode.NONE in (prefill, decode):
        return GraphMode.NONE
    return GraphMode.FULL_AND_PIECEWISE if decode.decode_mode() is GraphMode.FULL else GraphMode.PIECEWISE


@register_backend("hybrid")
class HybridBackend(AttentionBackend):
    """Routes EXTEND/MIXED batches to ``prefill`` and DECODE batches to ``decode`` (names or backends)."""

    graph_support = GraphMode.FULL_AND_PIECEWISE  # at most; supported_graph_mode asks the parts

    def __init__(
        self,
        kv_cache: KVCache,
        layers: Sequence[AttentionLayer] | Mapping[int, AttentionLayer],
        *,
        prefill: str | AttentionBackend = "auto",
        decode: str | AttentionBackend = "auto",
        prefill_options: Mapping[str, Any] | None = None,
        decode_options: Mapping[str, Any] | None = None,
    ) -> None:
        """``prefill`` / ``decode``: backend names (``create_backend`` names, "auto" included) or backends
        already built over ``kv_cache``; ``*_options``: keyword arguments for the named ones."""
        super().__init__(kv_cache, layers)
        self.prefill = self._part("prefill", prefill, prefill_options)
        self.decode = self._part("decode", decode, decode_options)
        self.name = f"{self.prefill.name}+{self.decode.name}"
        logger.info("hybrid attention backend: prefill %r, decode %r (graph support %s)",
                    self.prefill.name, self.decode.name, self.supported_graph_mode().value)

    def supported_graph_mode(self) -> GraphMode:
        return hybrid_graph_support(self.prefill.supported_graph_mode(), self.decode.supported_graph_mode())

    @property
    def decode_stores_kv_first(self) -> bool:  # type: ignore[override]  # decode rows run in the decode part
        return self.decode.decode_stores_kv_first

    def store_decode_kv_first(self) -> bool:
        return self.decode.store_decode_kv_first()

    def _part(self, role: str, spec: str | AttentionBackend, options: Mapping[str, Any] | None) -> AttentionBackend:
        if isinstance(spec, AttentionBackend):
            if spec.kv_cache is not self.kv_cache:
                raise ValueError(
                    f"the hybrid backend's {role} backend {spec.name!r} was built over a different KVCache; "
                    f"build both parts over the same cache (or pass backend names)"
                )
            if options:
                raise ValueError(f"{role}_options {dict(options)} given for an already built {role} backend")
            return spec
        if not isinstance(spec, str) or "+" in spec or spec == "hybrid":
            raise ValueError(
                f"hybrid {role} backend must be a single backend name such as 'fa3', 'flashinfer', 'triton', "
                f"'torch_native' or 'auto', or an AttentionBackend instance; got {spec!r}"
            )
        return create_backend(spec, self.kv_cache, self.layers, **dict(options or {}))

    def supports_tree_verify(self) -> bool:
        """Verification steps run on the prefill part: the pair verifies draft trees where it does."""
        return self.prefill.supports_tree_verify()

    def part_for(self, fb: ForwardBatch) -> AttentionBackend:
        """The backend that serves ``fb``: decode for DECODE batches, prefill otherwise (EXTEND, MIXED,
        TARGET_VERIFY)."""
        return self.decode if fb.forward_mode.is_decode() else self.prefill

    # ------------------------------------------------------------------ metadata contract
    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.decode.get_cuda_graph_seq_len_fill_value()

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if self.decode.supported_graph_mode().decode_mode() is GraphMode.FULL:
            self.decode.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        self.part_for(fb).init_forward_metadata_out_graph(fb, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, fb: ForwardBatch) -> None:
        self.part_for(fb).init_forward_metadata_in_graph(fb)

    # ------------------------------------------------------------------ compute
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        fb: ForwardBatch,
        out: torch.Tensor,
        save_kv_cache: bool = True,
    ) -> None:
        if fb.forward_mode.is_idle():
            return
        self.part_for(fb).forward(q, k, v, layer, fb, out, save_kv_cache)

    def forward_decode(self, q, k, v, layer, fb, out, save_kv_cache) -> None:
        self.decode.forward_decode(q, k, v, layer, fb, out, save_kv_cache)

    def forward_extend(self, q, k, v, layer, fb, out, save_kv_cache) -> None:
        self.prefill.forward_extend(q, k, v, layer, fb, out, save_kv_cache)
