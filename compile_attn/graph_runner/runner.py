"""GraphRunner: captures graphs per bucket and runs each step through the right one.

Decode batches fit a bucket of requests; extend and mixed batches a bucket of tokens. Per step the
runner picks the mode (full graph, piecewise, breakable, or eager), pads the batch into its static
buffers, calls ``backend.init_forward_metadata_out_graph`` on the padded view, replays, and returns the
outputs sliced to the real token count. It sets the forward context's ``graph_mode`` and ``bucket``: the compile
backend's piecewise wrappers capture and replay only on piecewise steps, at the bucket the runner names (the
runner owns the buckets). A decode batch carrying shared-prefix groups that the backend runs through its
shared-prefix (cascade) kernels goes to the piecewise graphs of its token count instead of a full decode graph
(``shared_prefix_route``): the kernels' grid follows the groups, so attention must run eagerly between pieces. A
chain verify batch (speculative decoding) whose requests all verify ``GraphConfig.verify_tokens`` tokens runs in a full
verify graph of its own, keyed by its number of requests (the decode buckets), where the backend supports a verify
mode (``AttentionBackend.supports_verify_mode``); other chain verify batches replay the full decode graph of their
token count, their tokens as decode rows (``verify_unroll.py``); the verify graphs' route and replay are
``verify_replay.py``'s. With ``GraphConfig.verify_trees`` the verify graphs are captured for draft trees (the
backend's per-token ancestor masks in a static buffer, written out of graph) and verify batches of draft trees whose
requests all verify ``verify_tokens`` tokens replay them too; other tree batches take the extend route. See
docs/graph_runner.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from compile_attn.batch import ForwardBatch, ForwardMode
from compile_attn.compiler.cuda_graph import frozen_gc, graph_pool
from compile_attn.config import GraphConfig
from compile_attn.context import forward_context
from compile_attn.graph_mode import GraphMode
from compile_attn.graph_runner.breakable import capture_segments
from compile_attn.graph_runner.full_graph import capture_full
from compile_attn.graph_runner.plan import ModePlan, is_compiled, plan_modes
from compile_attn.graph_runner.protocol import Route
from compile_attn.graph_runner.replay_view import ReplayViews, next_bucket
from compile_attn.graph_runner.segments import CapturedGraph, RerunGraph
from compile_attn.graph_runner.shortcuts import ModelCalls
from compile_attn.graph_runner.static_buffers import StaticBuffers
from compile_attn.graph_runner.stats import GraphRunnerStats
from compile_attn.graph_runner.verify import verify_runner
from compile_attn.graph_runner.outputs import slice_tokens
from compile_attn.graph_runner.verify_layout import view_parents
from compile_attn.graph_runner.verify_replay import run_verify, verify_plan
from compile_attn.graph_runner.verify_unroll import is_chain_verify, unroll_chain_verify
from compile_attn.graph_runner.warmup import warm_up
from compile_attn.graph_runner.step_kernels import TokenFeed

if TYPE_CHECKING:
    from compile_attn.attention.base import AttentionBackend

logger = logging.getLogger(__name__)

_FULL, _PIECEWISE = GraphMode.FULL, GraphMode.PIECEWISE


class GraphRunner:
    """Runs ``model(input_ids[T], positions[T])`` for ForwardBatches through CUDA graphs.

    ``model`` follows the model protocol (``attention_layers()``), possibly torch.compile'd.
    ``max_batch_size`` / ``max_num_tokens`` size the static buffers; buckets above them are dropped and
    larger batches run eagerly. Call ``capture()`` once, then ``run(batch)`` per step. Outputs of
    ``run`` live in graph memory: read them before the next ``run``.
    """

    def __init__(
        self,
        model: Any,
        backend: AttentionBackend,
        config: GraphConfig | None = None,
        *,
        max_batch_size: int,
        max_num_tokens: int,
    ) -> None:
        self.model = model
        self.backend = backend
        self.config = config = config or GraphConfig()
        self.device = torch.device(backend.device)
        self.compiled = is_compiled(model)
        self.plan: ModePlan = plan_modes(
            config.mode, backend.supported_graph_mode(), compiled=self.compiled, backend_name=backend.name
        )
        decode_limit = min(max_batch_size, max_num_tokens)
        self.decode_buckets: tuple[int, ...] = (
            tuple(s for s in config.decode_batch_sizes if s <= decode_limit)
            if self.plan.decode is not GraphMode.NONE
            else ()
        )
        self.extend_buckets: tuple[int, ...] = (
            tuple(s for s in config.extend_token_sizes if s <= max_num_tokens)
            if self.plan.extend is not GraphMode.NONE
            else ()
        )
        # Full verify graphs: requests x verify_tokens tokens, for the decode buckets whose tokens fit.
        self.verify_tokens = q = config.verify_tokens or 0
        # Tree verify graphs (config.verify_trees): every replay carries per-token ancestor masks (graph_runner/
        # verify_layout.py's view_parents); they need a backend that verifies trees.
        self.verify_trees = bool(config.verify_trees)
        self.verify_buckets: tuple[int, ...] = (
            tuple(s for s in self.decode_buckets if s * q <= decode_limit)
            if q and self.plan.decode is GraphMode.FULL and backend.supports_verify_mode(q)
            and (not self.verify_trees or backend.supports_tree_verify())
            else ()
        )
        self.buffers = StaticBuffers(max_batch_size, max_num_tokens, self.device)
        self.views = ReplayViews(self.buffers, backend.get_cuda_graph_seq_len_fill_value())
        self.stats = GraphRunnerStats()
        self.captured = False
        self.model_calls = ModelCalls(model, config, self.stats, compiled=self.compiled)
        self._graphs: dict[Route, CapturedGraph | RerunGraph] = {}
        self._verify_graphs: dict[int, CapturedGraph | RerunGraph] = {}  # by request bucket
        self.fallback_logged = False
        logger.info(
            "GraphRunner: decode -> %s (%d buckets, %d verify graphs of %d tokens per request), extend -> %s (%d "
            "buckets), backend %r on %s",
            self.plan.decode.value,
            len(self.decode_buckets),
            len(self.verify_buckets),
            self.verify_tokens,
            self.plan.extend.value,
            len(self.extend_buckets),
            backend.name,
            self.device,
        )

    # ------------------------------------------------------------------ buckets and routing
    def routes(self) -> list[tuple[GraphMode, str, int, int]]:
        """Every graph route as ``(mode, kind, smallest batch, bucket)``; kind is "decode" or "extend"."""
        out = []
        for kind, mode, buckets in (
            ("decode", self.plan.decode, self.decode_buckets),
            ("extend", self.plan.extend, self.extend_buckets),
        ):
            if mode is GraphMode.NONE:
                continue
            for lo, bucket in zip((0, *buckets), buckets):
                out.append((mode, kind, lo + 1, bucket))
        return out

    def capture_keys(self) -> list[Route]:
        """Graphs to capture, largest first (token-keyed graphs serve decode and extend alike)."""
        keys = {(mode, bucket) for mode, _, _, bucket in self.routes()}
        return sorted(keys, key=lambda k: (-k[1], k[0] is not GraphMode.FULL))

    def route(self, fb: ForwardBatch) -> Route | None:
        """``(mode, bucket)`` for this batch, or None to run it eagerly."""
        if fb.batch_size == 0 or fb.forward_mode.is_idle():
            return None
        if fb.forward_mode.is_decode():
            mode, bucket = self.plan.decode, next_bucket(self.decode_buckets, fb.batch_size)
        elif self.plan.decode is GraphMode.FULL and self.backend.decode_stores_kv_first and is_chain_verify(fb) and (
                bucket := next_bucket(self.decode_buckets, fb.num_tokens)) is not None:
            return GraphMode.FULL, bucket  # its tokens as decode rows (verify_unroll.py)
        else:
            mode, bucket = self.plan.extend, next_bucket(self.extend_buckets, fb.num_tokens)
            if fb.batch_size > self.buffers.max_batch_size:
                bucket = None
        if mode is GraphMode.NONE:
            return None
        if bucket is None:
            self._count_fallback(fb)
            return None
        return mode, bucket

    def verify_route(self, fb: ForwardBatch) -> int | None:
        """The request bucket of the full verify graph that runs ``fb`` (a chain verify batch whose requests verify
        ``verify_tokens`` tokens each, or fewer where ``verify_layout.end_aligned_rows`` can lay them out; with tree
        verify graphs also a batch of draft trees whose requests all verify ``verify_tokens`` tokens), or None (the
        batch takes ``route``'s way: decode rows or an extend)."""
        plan = verify_plan(self, fb)
        return None if plan is None else plan[0]

    def shared_prefix_route(self, fb: ForwardBatch) -> Route | None:
        """The piecewise ``(mode, token bucket)`` for a decode batch that carries shared-prefix groups the backend
        runs eagerly (``backend.takes_shared_prefix_decode``), or None (the batch takes ``route``'s way, with the
        groups unused where that is a full graph). The batch runs like an extend of one token per request: its
        tokens padded to the bucket, no padded requests, attention eager between the captured pieces."""
        if not fb.shared_prefix or not fb.forward_mode.is_decode() or not self.backend.takes_shared_prefix_decode():
            return None
        mode, bucket = self.plan.extend, next_bucket(self.extend_buckets, fb.num_tokens)
        if mode is GraphMode.NONE or bucket is None or fb.batch_size > self.buffers.max_batch_size:
            return None
        return mode, bucket

    def _count_fallback(self, fb: ForwardBatch) -> None:
        self.stats.eager_fallbacks += 1
        log = logger.debug if self.fallback_logged else logger.info
        self.fallback_logged = True
        log(
            "%s batch of %d requests / %d tokens is larger than the largest bucket (decode %s requests, "
            "extend %s tokens, %d requests): running it eagerly",
            fb.forward_mode.name,
            fb.batch_size,
            fb.num_tokens,
            self.decode_buckets[-1:] or "-",
            self.extend_buckets[-1:] or "-",
            self.buffers.max_batch_size,
        )

    # ------------------------------------------------------------------ capture
    def capture(self, warm_up: bool = True) -> GraphRunnerStats:
        """Capture every bucket (largest first) into the shared pool; logs time and graph memory. Then, with
        ``warm_up``, run dummy batches through every other path a step can take (``graph_runner.warmup``), so
        that no kernel is built on first traffic."""
        if self.captured:
            return self.stats
        keys = self.capture_keys()
        # (mode, bucket, verify graph?) by token count, largest first: verify graphs hold bucket x verify_tokens
        jobs = sorted([(m, b, False) for m, b in keys] + [(_FULL, b, True) for b in self.verify_buckets],
                      key=lambda j: -j[1] * (self.verify_tokens if j[2] else 1))
        if jobs:
            self.backend.init_cuda_graph_state(self.buffers.max_batch_size, self.buffers.max_num_tokens)
        cuda = self.device.type == "cuda"
        pool = graph_pool() if cuda else None
        stream = torch.cuda.Stream(self.device) if cuda else None
        start = time.perf_counter()
        if cuda:  # torch.cuda.graph empties the cache per capture: start and end empty so only graphs count
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(self.device)[0] if cuda else 0
        with torch.inference_mode(), frozen_gc():  # gc collected once, then frozen for every capture
            for i, (mode, bucket, verify) in enumerate(tqdm(jobs, desc="capturing graphs", unit="graph", leave=False,
                                                            disable=not jobs)):
                begin = time.perf_counter()
                self._capture_one(mode, bucket, pool, stream, verify)
                seconds = time.perf_counter() - begin
                self.stats.capture_seconds_by_mode[mode.value] += seconds
                if i == 0:
                    self.stats.first_capture_seconds = seconds
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self.stats.graph_memory_bytes = max(free_before - torch.cuda.mem_get_info(self.device)[0], 0)
        self.stats.capture_seconds = time.perf_counter() - start
        self.views.mark_all_dirty()
        self.captured = self.model_calls.armed = True
        logger.info(
            "captured %d graphs (%s; %d verify graphs) in %.2f s (%s; the first graph, with the model's first call: "
            "%.2f s) using %.1f MiB of graph memory",
            len(jobs),
            ", ".join(f"{m}: {n}" for m, n in sorted(self.stats.captures.items())) or "none",
            self.stats.verify_graphs,
            self.stats.capture_seconds,
            ", ".join(f"{m} {s:.2f} s" for m, s in sorted(self.stats.capture_seconds_by_mode.items())) or "-",
            self.stats.first_capture_seconds,
            self.stats.graph_memory_bytes / 2**20,
        )
        if warm_up:
            self.warm_up()
        if self.config.verify and keys:
            verify_runner(self)
        return self.stats

    def warm_up(self, run: Callable[[ForwardBatch], Any] | None = None, *, shared_prefix: bool = False) -> int:
        """Run dummy batches of every shape class through ``run`` (default ``self.run``) after capture: cached
        prefixes, mixed steps, eager batches over the largest buckets, on a GPU every alignment of the step's index
        tensors, with ``shared_prefix`` decode batches with a shared-prefix group (see ``graph_runner.warmup``).
        Step statistics are unchanged; returns the batches run."""
        if not self.captured:
            raise RuntimeError("GraphRunner.warm_up() runs after capture(): call runner.capture() first")
        return warm_up(self, run, shared_prefix=shared_prefix)

    def _capture_one(self, mode: GraphMode, bucket: int, pool: Any, stream: Any, verify: bool = False) -> None:
        """Capture the graph of ``(mode, bucket)``; ``verify``: the full verify graph of ``bucket`` requests."""
        backend, model = self.backend, self.model
        full = mode is GraphMode.FULL
        fill = backend.get_cuda_graph_seq_len_fill_value()
        if verify:
            view = self.views.verify_view(self._scratch_verify(bucket), bucket, self.verify_tokens)
            if self.verify_trees:  # chains as draft trees: the graph records the backend's tree variant
                view.draft_parents = view_parents(None, bucket, self.verify_tokens)
        else:
            view = self.buffers.dummy_decode(bucket, fill) if full else self.buffers.dummy_extend(bucket)
        backend.init_forward_metadata_out_graph(view, in_capture=True)
        if not full:  # attention runs eagerly between pieces: its graph-side metadata is eager too
            backend.init_forward_metadata_in_graph(view)

        def step() -> Any:
            if full:
                backend.init_forward_metadata_in_graph(view)
            return model(view.input_ids, view.positions)

        with forward_context(view, backend, graph_mode=mode, bucket=view.graph_bucket):
            if mode is GraphMode.PIECEWISE:  # the compile backend's wrappers warm up and capture this bucket
                step()
            else:
                step()  # warm-up: lazy initialisation (kernel compiles, library handles) happens outside the capture
                if full:
                    graph = capture_full(
                        step, device=self.device, pool=pool, stream=stream, traceable=not self.compiled
                    )
                else:
                    graph = capture_segments(step, device=self.device, pool=pool, stream=stream, breaks=True)
                if verify:
                    self._verify_graphs[bucket] = graph
                    self.stats.verify_graphs += 1
                else:
                    self._graphs[(mode, bucket)] = graph
                self.stats.segments += graph.num_segments if not full else 0
                self.stats.breaks += graph.num_breaks
        self.stats.captures[mode.value] += 1

    def _scratch_verify(self, bs: int) -> ForwardBatch:
        """A chain verify batch of ``bs`` requests x ``verify_tokens`` tokens on scratch memory (capture's)."""
        q = self.verify_tokens
        fb = ForwardBatch.build_scratch([0] * bs, [q] * bs, self.device)
        fb.forward_mode = ForwardMode.TARGET_VERIFY
        return fb

    # ------------------------------------------------------------------ run
    @torch.inference_mode()
    def run(self, fb: ForwardBatch, feed: TokenFeed | None = None) -> Any:
        """Run one step; returns the model output for the batch's real tokens. ``feed``: what the placeholders in
        ``fb.input_ids`` stand for (engine/execution/in_flight.py); a graph-bucketed decode step replaces them on the way into
        the static buffers, in the same kernel as the copy (``step_kernels.copy_decode_inputs``), others in place.
        The batch's pending request-table write (``fb.table_write_pending``) rides in that kernel too; other routes
        write it first (``fb.write_pending_table``).

        Capture and every step run under ``torch.inference_mode()``, whatever the caller's mode: the compiled
        model's Dynamo guards include the inputs' dispatch keys, which differ between inference-mode and
        no-grad tensors, so a step in another mode than capture would compile the model again (and capture its
        piecewise graphs again, on first use of each bucket)."""
        verify = verify_plan(self, fb) if fb.forward_mode.is_verify() else None
        if verify is not None:
            return run_verify(self, self._verify_graphs, fb, verify, feed)
        route = self.shared_prefix_route(fb) if fb.shared_prefix else None
        shared = route is not None
        if not shared:
            route = self.route(fb)
        # Into a decode graph: a decode batch, or a chain verify batch's tokens as decode rows (verify_unroll.py).
        decode_copy = route is not None and not shared and (fb.forward_mode.is_decode() or route[0] is _FULL)
        if feed is not None and not decode_copy:
            feed.apply(fb.input_ids)
            feed = None
        if route is None:
            return self.run_eager(fb)
        kv = self.backend.kv_cache
        fb.check(kv)  # a graph replay reads the batch unchecked: the eager entry's check here
        if not decode_copy:
            fb.write_pending_table(kv)
        if not self.captured:
            raise RuntimeError(
                "GraphRunner.run() needs graphs: call runner.capture() once before the first step"
            )
        mode, bucket = route
        if shared:  # the groups index the batch's requests, which the token-padded view keeps as they are
            view = self.views.extend_view(fb, bucket)
            view.shared_prefix, view.req_pool_indices_cpu = fb.shared_prefix, fb.req_pool_indices_cpu
            self.stats.shared_prefix_runs += 1
        elif decode_copy:
            rows = fb if fb.forward_mode.is_decode() else unroll_chain_verify(fb)
            view = self.views.decode_view(rows, bucket, feed, kv.req_to_token if fb.table_write_pending else None)
            fb.table_write_pending = False
        else:
            view = self.views.extend_view(fb, bucket)
        self.backend.init_forward_metadata_out_graph(view)
        if mode is not _FULL:
            self.backend.init_forward_metadata_in_graph(view)
        with forward_context(view, self.backend, graph_mode=mode, bucket=bucket):
            if mode is _PIECEWISE:
                out = self.model_calls.piecewise(view)
            else:
                out = self._graphs[route].replay()
        self.stats.runs[mode.value] += 1
        return slice_tokens(out, bucket, fb.num_tokens)

    @torch.inference_mode()
    def run_eager(self, fb: ForwardBatch) -> Any:
        """Run one step without graphs (the reference the graphs are checked against)."""
        self.backend.init_forward_metadata(fb)
        with forward_context(fb, self.backend, graph_mode=GraphMode.NONE):
            out = self.model_calls(fb, skip_guards=False)
        self.stats.runs[GraphMode.NONE.value] += 1
        return out
