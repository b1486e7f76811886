"""Greedy tokens of a model-protocol decoder by recompute: every token from a fresh full-sequence prefill through
the torch_native backend (new KV cache each time), so no cache reuse, batching or graphs: the engine's and the
CLI's reference."""

from __future__ import annotations

import torch

from compile_attn import ForwardBatch, KVCache, create_backend, forward_context
from compile_attn.models import ToyDecoder


def last_logits_by_recompute(model: ToyDecoder, tokens: list[int]) -> torch.Tensor:
    """The logits after ``tokens`` from a fresh full-sequence prefill (new cache): no reuse, no batching."""
    cfg = model.cfg
    kv = KVCache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                 max_batch_size=1, max_context=len(tokens), kv_cache_tokens=len(tokens), dtype=torch.float32)
    backend = create_backend("torch_native", kv, model.attention_layers())
    row = kv.alloc_request()
    fb = ForwardBatch.build(req_pool_indices=[row], prefix_lens=[0], extend_lens=[len(tokens)],
                            out_cache_loc=kv.alloc_extend([row], [len(tokens)]), input_ids=tokens)
    backend.init_forward_metadata(fb)
    with forward_context(fb, backend), torch.no_grad():
        return model(fb.input_ids, fb.positions)[-1]


def greedy_by_recompute(model: ToyDecoder, prompt: list[int], n: int) -> list[int]:
    """Each token from a fresh full-sequence prefill (new cache every time): no reuse, no batching."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(last_logits_by_recompute(model, tokens).argmax()))
    return tokens[len(prompt):]
