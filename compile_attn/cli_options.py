"""Command-line options that every engine-building subcommand (throughput, serve) shares: device, attention
backend, graph mode, compile switch and the engine's sizes. Each command keeps its own defaults for the sizes."""

from __future__ import annotations

import argparse


def add_engine_options(p: argparse.ArgumentParser, *, device_help: str, max_batch_size: int,
                       max_num_tokens: int) -> None:
    """--device, --backend, --graph-mode, --no-compile, --no-overlap, --max-batch-size, --max-num-tokens,
    --kv-cache-tokens."""
    p.add_argument("--device", default=None, help=device_help)
    p.add_argument("--backend", default="auto", help="attention backend (see `compile-attn info`)")
    p.add_argument("--graph-mode", default="full_and_piecewise", help="CUDA graphs (see GraphMode)")
    p.add_argument("--no-compile", action="store_true", help="do not torch.compile the model")
    p.add_argument("--no-overlap", action="store_true",
                   help="read each step's tokens before scheduling the next (default: one step in flight)")
    p.add_argument("--max-batch-size", type=int, default=max_batch_size, help="requests per step at most")
    p.add_argument("--max-num-tokens", type=int, default=max_num_tokens, help="tokens per step at most")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="KV cache capacity (default: the engine's)")
