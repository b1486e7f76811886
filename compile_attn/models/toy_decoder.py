"""ToyDecoder: a tiny Llama-like decoder whose attention is ``torch.ops.compile_attn.attention``.

Takes a ragged batch as flat ``input_ids[T]`` and ``positions[T]`` and returns logits ``[T, vocab]``;
per-step state comes from the forward context. Rotary embeddings, RMSNorm, GQA, SwiGLU MLP. Used by
tests, the quickstart example and benchmarks where loading an HF model is not the point.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from compile_attn.layer import AttentionLayer


@dataclass(frozen=True)
class ToyDecoderConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    sliding_window: int | None = None
    logit_cap: float = 0.0


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., : d // 2].float(), x[..., d // 2 :].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class ToyDecoderLayer(nn.Module):
    def __init__(self, cfg: ToyDecoderConfig, layer_id: int) -> None:
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        h, d = cfg.hidden_size, cfg.head_dim
        self.input_norm = nn.RMSNorm(h)
        self.qkv_proj = nn.Linear(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.post_norm = nn.RMSNorm(h)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        q, k, v = self.qkv_proj(self.input_norm(x)).split(
            [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim], dim=-1
        )
        q = _rotate(q.view(t, cfg.num_heads, cfg.head_dim), positions, cfg.rope_theta)
        k = _rotate(k.view(t, cfg.num_kv_heads, cfg.head_dim), positions, cfg.rope_theta)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        out = torch.empty_like(q)
        torch.ops.compile_attn.attention(q, k, v, out, self.layer_id)
        x = x + self.o_proj(out.view(t, -1))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class ToyDecoder(nn.Module):
    def __init__(self, cfg: ToyDecoderConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or ToyDecoderConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(ToyDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def attention_layers(self) -> list[AttentionLayer]:
        cfg = self.cfg
        return [
            AttentionLayer(i, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           sliding_window=cfg.sliding_window, logit_cap=cfg.logit_cap)
            for i in range(cfg.num_layers)
        ]

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(self.hidden_states(input_ids, positions))
