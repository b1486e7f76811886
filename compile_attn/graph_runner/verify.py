"""Verify option: right after capture, run every captured bucket once on a random batch and compare
the graph's output with eager execution; a mismatch raises, naming the bucket and the mode.

Batches are built on the runner's own KV cache (requests allocated, run, then freed), so verify needs
free room in the cache; a bucket that cannot fit is skipped with a warning, never silently passed.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from typing import Any

import torch
from torch import nn

from compile_attn.batch import ForwardBatch, ForwardMode
from compile_attn.errors import CompileAttnError

from compile_attn.graph_runner.protocol import RunnerLike

logger = logging.getLogger(__name__)

_MAX_PREFIX = 8
_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}
_LOW_PRECISION_TOLERANCE = 3e-2


class GraphVerificationError(CompileAttnError, RuntimeError):
    """A captured graph's output differs from eager execution of the same batch."""


def vocab_size(model: Any) -> int:
    """Rows of the model's first embedding table (1 if it has none: then every token id is 0)."""
    modules = model.modules() if isinstance(model, nn.Module) else ()
    for m in modules:
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    return 1


def _split(total: int, parts: int, rng: random.Random) -> list[int]:
    cuts = sorted(rng.sample(range(1, total), parts - 1)) if parts > 1 else []
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


def random_batch(
    runner: RunnerLike, kind: str, lo: int, hi: int, rng: random.Random
) -> tuple[ForwardBatch, list[int]] | None:
    """A random decode batch of ``lo..hi`` requests or extend batch of ``lo..hi`` tokens, in the KV cache."""
    kv = runner.backend.kv_cache
    max_ctx = kv.max_context
    n = rng.randint(lo, hi)
    if kind == "decode":
        extend = [1] * n
        prefix = [rng.randint(1, min(_MAX_PREFIX, max_ctx - 1)) for _ in range(n)]
    else:
        per_request = max(max_ctx - _MAX_PREFIX, 1)
        fewest = -(-n // per_request)
        most = min(4, n, runner.buffers.max_batch_size)
        if fewest > most:
            return None
        extend = _split(n, rng.randint(fewest, most), rng)
        prefix = [rng.randint(0, min(_MAX_PREFIX, max_ctx - e)) for e in extend]
    if kv.req_to_token_pool.available < len(extend) or kv.available_tokens < sum(prefix) + sum(
        extend
    ) + kv.page_size * len(extend):
        return None
    rows = [kv.alloc_request() for _ in extend]
    kv.alloc_extend(rows, prefix)
    loc = kv.alloc_extend(rows, extend)
    vocab = vocab_size(runner.model)
    ids = [rng.randrange(vocab) for _ in range(sum(extend))]
    mode = ForwardMode.DECODE if kind == "decode" else ForwardMode.EXTEND  # 1-token extends stay extends
    fb = ForwardBatch.build(
        req_pool_indices=rows,
        prefix_lens=prefix,
        extend_lens=extend,
        out_cache_loc=loc,
        input_ids=ids,
        forward_mode=mode,
        device=kv.device,
    )
    return fb, rows


def compare(graph_out: torch.Tensor, eager_out: torch.Tensor, what: str) -> float:
    """Max abs difference relative to the eager output's scale; GraphVerificationError past tolerance."""
    if graph_out.shape != eager_out.shape or graph_out.dtype != eager_out.dtype:
        raise GraphVerificationError(
            f"{what}: graph output {tuple(graph_out.shape)} {graph_out.dtype} != eager output "
            f"{tuple(eager_out.shape)} {eager_out.dtype}"
        )
    tol = _TOLERANCE.get(eager_out.dtype, _LOW_PRECISION_TOLERANCE)
    scale = eager_out.float().abs().max().clamp(min=1e-6)
    err = float((graph_out.float() - eager_out.float()).abs().max() / scale) if eager_out.numel() else 0.0
    if not err <= tol:  # also catches NaN
        raise GraphVerificationError(
            f"{what}: graph replay differs from eager execution (max relative error {err:.3g} > {tol:g}). "
            f"The backend's metadata contract or the runner's padding is wrong for this bucket; run with "
            f"graph mode 'none' to continue without graphs"
        )
    return err


def verify_runner(runner: RunnerLike, seed: int = 0) -> int:
    """Check every captured (mode, kind, bucket) once; returns how many were checked."""
    rng = random.Random(seed)
    saved_runs = Counter(runner.stats.runs)
    kv = runner.backend.kv_cache
    checked = 0
    for mode, kind, lo, bucket in runner.routes():
        made = random_batch(runner, kind, lo, bucket, rng)
        if made is None:
            logger.warning(
                "verify skipped %s %s bucket %d: the KV cache has no room for a test batch",
                mode.value,
                kind,
                bucket,
            )
            continue
        fb, rows = made
        what = (
            f"graph mode {mode.value!r}, {kind} bucket {bucket} "
            f"(batch of {fb.batch_size} requests, {fb.num_tokens} tokens)"
        )
        try:
            route = runner.route(fb)
            if route != (mode, bucket):
                raise GraphVerificationError(f"{what}: the runner routed it to {route}, not to this bucket")
            eager = runner.run_eager(fb).clone()
            graph = runner.run(fb).clone()
            compare(graph, eager, what)
        finally:
            for row in rows:
                kv.free_request(row)
        checked += 1
    runner.stats.runs = saved_runs
    runner.stats.verified += checked
    logger.info("verify: %d graph buckets replay the same outputs as eager execution", checked)
    return checked
