"""Start-up warm-up: run dummy batches through every path a GraphRunner can route a step to, so first traffic
builds nothing.

Capture runs each bucket once with one request and no cached prefix. Real steps also take other paths: extend
and mixed batches whose requests have cached prefixes (kernels that build the prefix index run only then),
batches larger than the largest bucket (eager), and every batch size's own host tensors. Compiled GPU kernels
(Triton's JIT) are built per specialisation, and Triton specialises pointer arguments on 16-byte alignment:
a step's index tensors are views into one upload whose offsets follow the batch size and token count, so on
a GPU each path runs with 1-4 requests and 4 token-count residues (every alignment of those views). Each
bucket also runs once with prefixes and several requests (on a GPU, where it costs a replay), and mixed batches run
with as many decode rows as the decode sizes have (a backend's decode-row kernel is specialised on the count). With
``shared_prefix`` (the engine's ``cascade_decode``), decode batches carrying a shared-prefix group run too, through
the runner's shared-prefix route (the backend's cascade kernels). Dummy requests use row ``PAD_REQUEST`` and write
only ``PAD_SLOT``, as capture's dummy batches do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from compile_attn.batch import ForwardBatch
from compile_attn.graph_mode import GraphMode

from compile_attn.graph_runner.protocol import RunnerLike

logger = logging.getLogger(__name__)

Shape = tuple[tuple[int, ...], tuple[int, ...]]  # (prefix length, new tokens) per request


def _even(tokens: int, requests: int) -> list[int]:
    base, rest = divmod(tokens, requests)
    return [base + 1] * rest + [base] * (requests - rest)


def extend_shapes(num_requests: int, tokens: int, max_context: int) -> Iterator[Shape]:
    """Extend batches of ``num_requests`` requests adding ``tokens`` tokens in all: a mixed batch (decodes, then a
    prompt with no prefix taking the other tokens), a chunked prefill (every request with a prefix) and fresh
    prompts; each only where every request fits ``max_context``."""
    mixed = ((1,) * (num_requests - 1) + (0,), (1,) * (num_requests - 1) + (tokens - num_requests + 1,))
    for prefix, lens in (mixed, ((1,) * num_requests, tuple(_even(tokens, num_requests))),
                         ((0,) * num_requests, tuple(_even(tokens, num_requests)))):
        if min(lens) >= 1 and all(p + n <= max_context for p, n in zip(prefix, lens)):
            yield prefix, lens


def decode_sizes(lo: int, hi: int, variants: int, thresholds: bool) -> list[int]:
    """Decode batch sizes in ``(lo, hi]`` to run eagerly: the first ``variants`` ones, ``hi``, and with
    ``thresholds`` every power of two and the size after it (GPU kernel configurations change at such sizes)."""
    sizes = set(range(lo + 1, min(lo + variants, hi) + 1)) | ({hi} if hi > lo else set())
    p = 1
    while thresholds and p <= hi:
        sizes |= {s for s in (p, p + 1) if lo < s <= hi}
        p *= 2
    return sorted(sizes)


def warmup_shapes(runner: RunnerLike) -> list[Shape]:
    """Every batch shape the warm-up runs for ``runner`` (dummy requests of the shapes a scheduler can send)."""
    cuda = runner.device.type == "cuda"
    variants = 4 if cuda else 1  # CPU kernels are not specialised per alignment: one batch per path
    max_bs, max_tokens = runner.buffers.max_batch_size, runner.buffers.max_num_tokens
    max_context = runner.backend.kv_cache.max_context
    shapes: list[Shape] = []

    def extend(requests: int, tokens: int) -> None:
        if 1 <= requests <= max_bs and requests <= tokens <= max_tokens:
            shapes.extend(extend_shapes(requests, tokens, max_context))

    # Extend / mixed: small batches (a bucket's graph, or eager where extend has no graphs), then batches just
    # over the largest token bucket, which run eagerly.
    for first in (4, runner.extend_buckets[-1] + 1 if runner.extend_buckets else None):
        if first is None:
            continue
        fewest = -(-first // max(max_context - 1, 1))  # requests the tokens need (each fits max_context)
        for requests in range(fewest, fewest + max(variants, 2)):  # 2: a mixed batch has a decode and a prompt
            for extra in range(variants):
                extend(requests, first + extra)
    if cuda:  # every token bucket once with prefixes and several requests (a replay each)
        for bucket in runner.extend_buckets:
            extend(min(3, bucket), bucket)
        # Mixed batches of many decode rows beside a short prompt: a backend may run those rows in a decode kernel of
        # their own (triton: attention/triton/mixed.py), whose tiles change with the row count (small batches) and
        # whose index views follow it (alignment), so the row counts of the decode sizes run too.
        prompt = 4
        if max_context > prompt:
            for rows in decode_sizes(0, min(max_bs - 1, max_tokens - prompt), variants, thresholds=True):
                shapes.append(((1,) * rows + (0,), (1,) * rows + (prompt,)))
    # Decode: the sizes that run eagerly (over the largest bucket, or all without decode graphs); on a GPU also
    # one padded batch per bucket.
    lo = runner.decode_buckets[-1] if runner.plan.decode is not GraphMode.NONE and runner.decode_buckets else 0
    decode = decode_sizes(lo, min(max_bs, max_tokens), variants, thresholds=cuda)
    if cuda:
        decode += [max(b - 1, 1) for b in runner.decode_buckets]
    if max_context >= 2:  # a decode request has at least one cached token
        shapes.extend(((1,) * bs, (1,) * bs) for bs in decode)
    return list(dict.fromkeys(shapes))  # in order, each once


def shared_prefix_batches(runner: RunnerLike) -> list[ForwardBatch]:
    """Decode batches of 4 request counts (every alignment of the cascade index's views on a GPU; one on the CPU)
    whose requests share a ``prefix``-token group, all of them or all but the last, for a runner that routes such
    batches (``GraphRunner.shared_prefix_route``); empty when it routes none."""
    from compile_attn.kv.shared_prefix import MIN_REQUESTS
    from compile_attn.batch import SharedPrefixGroup

    max_context = runner.backend.kv_cache.max_context
    prefix = min(16, max_context - 1)
    if prefix < 1 or not runner.backend.takes_shared_prefix_decode():
        return []
    batches = []
    for bs in range(MIN_REQUESTS + 1, MIN_REQUESTS + (5 if runner.device.type == "cuda" else 2)):
        for members in (bs, bs - 1):
            fb = dummy_batch(((prefix,) * bs, (1,) * bs), runner.device)
            fb.shared_prefix = (SharedPrefixGroup(tuple(range(members)), prefix),)
            if runner.shared_prefix_route(fb) is not None:
                batches.append(fb)
    return batches


def dummy_batch(shape: Shape, device: torch.device) -> ForwardBatch:
    """A batch of ``shape`` on row ``PAD_REQUEST``, every new token written to ``PAD_SLOT``, built as the engine
    builds its steps (host lists, outside inference mode: the tensor kinds the compiled model's guards saw)."""
    prefix, lens = shape
    with torch.inference_mode(False):
        return ForwardBatch.build_scratch(prefix, lens, device)


def warm_up(runner: RunnerLike, run: Callable[[ForwardBatch], Any] | None = None, *,
            shared_prefix: bool = False) -> int:
    """Run every ``warmup_shapes`` batch (and with ``shared_prefix`` every ``shared_prefix_batches`` batch) through
    ``run`` (default ``runner.run``); the runner's step statistics are left as they were. Returns how many batches
    ran."""
    run = run or runner.run
    stats = runner.stats
    saved = (stats.runs.copy(), stats.eager_fallbacks, stats.direct_calls, stats.shared_prefix_runs,
             runner.fallback_logged)
    runner.fallback_logged = True  # the warm-up's eager batches are not news: no log line for them
    start = time.perf_counter()
    batches = [dummy_batch(shape, runner.device) for shape in warmup_shapes(runner)]
    if shared_prefix:
        batches += shared_prefix_batches(runner)
    try:
        for fb in batches:
            run(fb)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    finally:
        (stats.runs, stats.eager_fallbacks, stats.direct_calls, stats.shared_prefix_runs,
         runner.fallback_logged) = saved
    logger.info("warm-up: %d dummy batches through every step path in %.2f s", len(batches),
                time.perf_counter() - start)
    return len(batches)
