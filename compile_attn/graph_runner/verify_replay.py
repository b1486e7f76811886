"""Verify graph replay: a verify batch (chains, or draft trees) through the full verify graph of its request bucket.

``GraphRunner.run`` sends here the verify batches that ``verify_plan`` finds a verify graph for. A batch whose
requests verify fewer than Q = ``GraphConfig.verify_tokens`` tokens takes the end-aligned layout
(``verify_layout.end_aligned_rows``): its per-request fields go up in one copy, the graph's view holds each request's
tokens in the last rows of its Q, and the real tokens' output rows are gathered back in the batch's order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from compile_attn.batch import ForwardBatch
from compile_attn.context import forward_context
from compile_attn.graph_mode import GraphMode
from compile_attn.graph_runner.outputs import gather_rows, slice_tokens
from compile_attn.graph_runner.replay_view import next_bucket
from compile_attn.graph_runner.step_kernels import TokenFeed
from compile_attn.graph_runner.verify_layout import end_aligned_rows, view_parents
from compile_attn.host_tensors import to_device_groups

if TYPE_CHECKING:
    from compile_attn.attention.base import AttentionBackend
    from compile_attn.graph_runner.replay_view import ReplayViews
    from compile_attn.graph_runner.segments import CapturedGraph, RerunGraph
    from compile_attn.graph_runner.stats import GraphRunnerStats

VerifyPlan = tuple[int, "list[int] | None"]  # (request bucket, each real token's row where end-aligned)


class VerifyRunner(Protocol):
    """The members of ``GraphRunner`` read here (a protocol: this module does not import the runner's)."""

    backend: AttentionBackend
    device: torch.device
    views: ReplayViews
    stats: GraphRunnerStats
    captured: bool
    verify_tokens: int
    verify_trees: bool
    verify_buckets: tuple[int, ...]


def verify_plan(runner: VerifyRunner, fb: ForwardBatch) -> VerifyPlan | None:
    """``(bucket, rows)`` for a verify batch that a full verify graph of ``bucket`` requests runs, else None (see
    ``GraphRunner.verify_route``). ``rows``: each real token's row in the graph's layout (``end_aligned_rows``)
    where the batch is not a chain of ``verify_tokens`` tokens per request, else None; worked out once per step, for
    the route and the replay."""
    if not runner.verify_buckets or not fb.forward_mode.is_verify():
        return None
    q = runner.verify_tokens
    if fb.draft_parents is not None and (not runner.verify_trees or fb.extend_seq_lens_cpu.count(q) != fb.batch_size):
        return None
    rows = None
    if fb.chain_verify_tokens() != q:  # fewer tokens for some requests (or trees): the last rows of their Q
        rows = end_aligned_rows(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, q)
        if rows is None:  # a tree batch here has q tokens per request: its rows are never None
            return None
    bucket = next_bucket(runner.verify_buckets, fb.batch_size)
    return None if bucket is None else (bucket, rows)


def run_verify(runner: VerifyRunner, graphs: dict[int, CapturedGraph | RerunGraph], fb: ForwardBatch,
               plan: VerifyPlan, feed: TokenFeed | None) -> Any:
    """Replay ``graphs[bucket]``, the full verify graph of ``verify_plan``'s bucket, for the verify batch ``fb``
    (chains, or draft trees); the outputs of its real tokens, in the batch's order."""
    if not runner.captured:
        raise RuntimeError("GraphRunner.run() needs graphs: call runner.capture() once before the first step")
    bucket, rows = plan
    if feed is not None:
        feed.apply(fb.input_ids)
    backend = runner.backend
    kv = backend.kv_cache
    fb.check(kv)
    fb.write_pending_table(kv)
    q, bs = runner.verify_tokens, fb.batch_size
    end_aligned = None
    if rows is not None:
        prefix = [s + n - q for s, n in zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)]  # seq_len - Q
        (rows_dev,), int32_fields = to_device_groups(
            [([rows], torch.int64), ([prefix, [q] * bs, list(range(0, bs * q, q))], torch.int32)], runner.device)
        end_aligned = (rows_dev, int32_fields, prefix)
    view = runner.views.verify_view(fb, bucket, q, end_aligned)
    if runner.verify_trees:  # the backend writes the trees' masks into its static buffer (out of graph)
        view.draft_parents = view_parents(fb.draft_parents, bucket, q)
    backend.init_forward_metadata_out_graph(view)
    with forward_context(view, backend, graph_mode=GraphMode.FULL, bucket=view.graph_bucket):
        out = graphs[bucket].replay()
    runner.stats.runs[GraphMode.FULL.value] += 1
    runner.stats.verify_runs += 1
    if end_aligned is not None:
        return gather_rows(out, view.num_tokens, end_aligned[0])
    return slice_tokens(out, view.num_tokens, fb.num_tokens)
