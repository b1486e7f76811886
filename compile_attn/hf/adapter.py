"""HFModelAdapter: an HF causal LM seen through compile_attn's model protocol.

``adapter(input_ids[T], positions[T]) -> logits[T, V]`` runs the HF model on one flattened ragged
batch (``[1, T]`` ids with explicit position ids, no HF KV cache) and ``attention_layers()`` gives the
per-layer constants the attention backend needs. It owns no KV cache and no batch state: those come
from the forward context set by the engine or graph runner.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from compile_attn.arg_checks import renamed_keywords
from compile_attn.hf.attention import ATTN_IMPLEMENTATION
from compile_attn.hf.families import attention_layers, check_supported
from compile_attn.hf.registration import register
from compile_attn.kv.cache import KV_CACHE_RENAMED, KVCache
from compile_attn.layer import AttentionLayer
from compile_attn.ops.gemv import linear


class HFModelAdapter(nn.Module):
    """Wrap an HF ``*ForCausalLM``; switches it to ``attn_implementation="compile_attn"`` if needed."""

    def __init__(self, model: nn.Module, tokenizer: Any | None = None) -> None:
        super().__init__()
        check_supported(model.config)
        if model.config._attn_implementation != ATTN_IMPLEMENTATION:
            register()
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.tokenizer = tokenizer
        self._layers = attention_layers(model)

    # ------------------------------------------------------------------ model protocol
    def attention_layers(self) -> list[AttentionLayer]:
        return list(self._layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[T, V]`` of a flattened batch, or ``[len(logits_indices), V]`` for just those tokens."""
        extra = {} if logits_indices is None else {"logits_to_keep": logits_indices}
        # An all-ones 2D mask: HF then skips its packed-sequence probe of position_ids (a host sync in
        # eager mode, a graph break under torch.compile); the compile_attn mask function ignores it.
        ones = torch.ones_like(input_ids, dtype=torch.bool)[None]
        out = self.model(
            input_ids=input_ids[None], position_ids=positions[None], attention_mask=ones, use_cache=False, **extra
        )
        return out.logits[0]

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` (the decoder stack and its final norm, no LM head)."""
        ones = torch.ones_like(input_ids, dtype=torch.bool)[None]
        out = self.model.model(input_ids=input_ids[None], position_ids=positions[None], attention_mask=ones,
                               use_cache=False)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the given hidden states: the LM head plus the final softcap where the family has one
        (Gemma2/3 ``final_logit_softcapping``), exactly as the HF ``*ForCausalLM.forward`` applies them."""
        head = self.model.lm_head
        # A plain linear head at one row (single-stream decode) through the gemv kernel: it reads the head's weight
        # faster than cuBLAS does (docs/performance.md); a sharded head (ParallelLMHead) does the same inside.
        logits = linear(hidden, head.weight, head.bias) if type(head) is nn.Linear else head(hidden)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ------------------------------------------------------------------ conveniences
    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def make_kv_cache(
        self,
        *,
        max_batch_size: int | None = None,
        max_context: int,
        kv_cache_tokens: int | None = None,
        page_size: int = 1,
        dtype: torch.dtype | None = None,
        **deprecated: int,
    ) -> KVCache:
        """A KVCache shaped for this model (layers, KV heads, head_dim), on its device and dtype. The former
        names ``max_requests`` and ``num_tokens`` still work, with a DeprecationWarning."""
        renamed = renamed_keywords("make_kv_cache", deprecated, KV_CACHE_RENAMED)
        return KVCache.for_layers(
            self._layers,
            max_batch_size=renamed.get("max_batch_size", max_batch_size),
            max_context=max_context,
            kv_cache_tokens=renamed.get("kv_cache_tokens", kv_cache_tokens),
            page_size=page_size,
            dtype=dtype or self.dtype,
            device=self.device,
        )
