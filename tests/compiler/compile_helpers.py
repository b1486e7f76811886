"""Helpers for compile-backend tests: a ToyDecoder step on a fresh KV cache, small models, graph catching."""

from __future__ import annotations

import torch
from torch import fx, nn

from compile_attn import ForwardBatch, KVCache, create_backend, forward_context
from compile_attn.models.toy_decoder import ToyDecoder, ToyDecoderConfig

SMALL = ToyDecoderConfig(vocab_size=128, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                         head_dim=8, intermediate_size=64)


def toy_model(cfg: ToyDecoderConfig = SMALL, device: str = "cpu", dtype: torch.dtype = torch.float32,
              seed: int = 0) -> ToyDecoder:
    torch.manual_seed(seed)
    return ToyDecoder(cfg).to(device=device, dtype=dtype).eval()


def split_tokens(num_tokens: int, max_per_request: int = 7) -> list[int]:
    """Extend lengths of a few requests adding up to ``num_tokens``."""
    lens = []
    while num_tokens > 0:
        lens.append(min(max_per_request, num_tokens))
        num_tokens -= lens[-1]
    return lens


def run_step(
    model: nn.Module,
    cfg: ToyDecoderConfig,
    num_tokens: int,
    seed: int,
    device: str = "cpu",
    input_ids: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    kv_dtype: torch.dtype = torch.float32,
    bucket: int | None = None,
) -> torch.Tensor:
    """One extend step of fresh requests (random cached prefixes of the same seed) on a fresh KV cache.

    ``input_ids`` / ``positions``, when given, are the tensors passed to the model (e.g. static buffers):
    the step's ids and positions are copied into them first. ``bucket``: run it as a graph runner's piecewise step
    of that bucket (the forward context names the mode and the bucket), so piecewise wrappers capture or replay.
    """
    gen = torch.Generator().manual_seed(seed)
    kv = KVCache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                 max_batch_size=64, max_context=256, kv_cache_tokens=4096, page_size=1, dtype=kv_dtype,
                 device=device)
    backend = create_backend("torch_native", kv, model.attention_layers())
    extend_lens = split_tokens(num_tokens)
    prefix_lens = [int(torch.randint(0, 9, (1,), generator=gen)) for _ in extend_lens]
    rows = [kv.alloc_request() for _ in extend_lens]
    prefix_loc = kv.alloc_extend(rows, prefix_lens)
    for layer in range(cfg.num_layers):
        n = prefix_loc.shape[0]
        k = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(device=device, dtype=kv_dtype)
        v = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(device=device, dtype=kv_dtype)
        kv.pool.set_kv(layer, prefix_loc, k, v)
    loc = kv.alloc_extend(rows, extend_lens)
    ids = torch.randint(0, cfg.vocab_size, (num_tokens,), generator=gen).to(device)
    fb = ForwardBatch.build(req_pool_indices=rows, prefix_lens=prefix_lens, extend_lens=extend_lens,
                            out_cache_loc=loc, input_ids=ids, device=device)
    backend.init_forward_metadata(fb)
    if input_ids is not None:
        input_ids.copy_(fb.input_ids)
    if positions is not None:
        positions.copy_(fb.positions)
    mode = None if bucket is None else "piecewise"
    with forward_context(fb, backend, graph_mode=mode, bucket=bucket), torch.no_grad():
        ids = fb.input_ids if input_ids is None else input_ids
        out = model(ids, fb.positions if positions is None else positions)
    return out.clone()


class GatedMLP(nn.Module):
    """A model with no split op: one piece."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))


class GraphCatcher:
    """A Dynamo backend that keeps the graphs it is given and runs them unchanged."""

    def __init__(self) -> None:
        self.graphs: list[fx.GraphModule] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> fx.GraphModule:
        self.graphs.append(gm)
        return gm
