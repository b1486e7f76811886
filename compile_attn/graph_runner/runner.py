"""GraphRunner: captures graphs per bucket and runs each step through the right one.

Decode batches fit a bucket of requests; extend and mixed batches a bucket of tokens. Per step the
runner picks the mode (full graph, piecewise, breakable, or eager), pads the batch into its static
buffers, calls ``backend.init_forward_metadata_out_graph`` on the padded view, replays, and returns the
outputs sliced to the real token count. It sets the forward context's ``graph_mode`` so the compile
backend's piecewise wrappers capture only when the step runs piecewise. See docs/graph_runner.md.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree
from tqdm import tqdm

from compile_attn.batch import ForwardBatch
from compile_attn.compiler.graph_calls import DirectCall, record_graph_calls
from compile_attn.context import forward_context
from compile_attn.graph_runner.breakable import capture_segments
from compile_attn.graph_runner.full_graph import capture_full
from compile_attn.graph_runner.memory_pool import get_graph_pool
from compile_attn.graph_runner.plan import ExecMode, ModePlan, is_compiled, plan_modes
from compile_attn.graph_runner.replay_view import ReplayViews, next_bucket
from compile_attn.graph_runner.segments import CapturedGraph, RerunGraph, capture_session
from compile_attn.graph_runner.static_buffers import StaticBuffers
from compile_attn.graph_runner.stats import GraphRunnerStats

if TYPE_CHECKING:
    from compile_attn.attention.base import AttentionBackend
    from compile_attn.config import GraphConfig

logger = logging.getLogger(__name__)

Route = tuple[ExecMode, int]


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
        from compile_attn.config import GraphConfig  # late: config imports graph_runner.mode

        self.model = model
        self.backend = backend
        self.config = config = config or GraphConfig()
        self.device = torch.device(backend.device)
        self.compiled = is_compiled(model)
        self.plan: ModePlan = plan_modes(
            config.mode, backend.graph_support, compiled=self.compiled, backend_name=backend.name
        )
        decode_limit = min(max_batch_size, max_num_tokens)
        self.decode_buckets: tuple[int, ...] = (
            tuple(s for s in config.decode_batch_sizes if s <= decode_limit)
            if self.plan.decode is not ExecMode.NONE
            else ()
        )
        self.extend_buckets: tuple[int, ...] = (
            tuple(s for s in config.prefill_token_sizes if s <= max_num_tokens)
            if self.plan.extend is not ExecMode.NONE
            else ()
        )
        self.buffers = StaticBuffers(max_batch_size, max_num_tokens, self.device)
        self.views = ReplayViews(self.buffers, backend.get_cuda_graph_seq_len_fill_value())
        self.stats = GraphRunnerStats()
        self.captured = False
        self._model_calls = 0  # calls of the model through run / run_eager (not capture)
        self._guards_needed = False  # set if a call with guards skipped had to recompile
        # per token count of a piecewise bucket: its direct graph call (None: the model allows none)
        self._direct_calls: dict[int, DirectCall | None] = {}
        self._graphs: dict[Route, CapturedGraph | RerunGraph] = {}
        self._warned_fallback = False
        logger.info(
            "GraphRunner: decode -> %s (%d buckets), extend -> %s (%d buckets), backend %r on %s",
            self.plan.decode.value,
            len(self.decode_buckets),
            self.plan.extend.value,
            len(self.extend_buckets),
            backend.name,
            self.device,
        )
        self._check_piecewise_sizes()

    def _check_piecewise_sizes(self) -> None:
        """Warn when the compiled model's backend captures piecewise graphs at other sizes than this runner's
        piecewise buckets: those buckets would run their pieces without graphs (slow, still correct)."""
        options = getattr(self.model, "options", None) if self.compiled else None
        if options is None or self.device.type != "cuda":
            return
        from compile_attn.compiler.backend import piecewise_capture_sizes
        from compile_attn.config import GraphConfig

        wanted = set(self.decode_buckets) if self.plan.decode is ExecMode.PIECEWISE else set()
        wanted |= set(self.extend_buckets) if self.plan.extend is ExecMode.PIECEWISE else set()
        missing = sorted(wanted - set(piecewise_capture_sizes(GraphConfig.from_options(options))))
        if missing:
            logger.warning(
                "GraphRunner: piecewise buckets %s are not capture sizes of the compiled model (its options give "
                "%s), so their pieces run without CUDA graphs; compile with the runner's sizes, e.g. "
                "compile_model(model, {'mode': ..., 'decode_batch_sizes': ..., 'prefill_token_sizes': ...})",
                missing, sorted(piecewise_capture_sizes(GraphConfig.from_options(options))),
            )

    # ------------------------------------------------------------------ buckets and routing
    def routes(self) -> list[tuple[ExecMode, str, int, int]]:
        """Every graph route as ``(mode, kind, smallest batch, bucket)``; kind is "decode" or "extend"."""
        out = []
        for kind, mode, buckets in (
            ("decode", self.plan.decode, self.decode_buckets),
            ("extend", self.plan.extend, self.extend_buckets),
        ):
            if mode is ExecMode.NONE:
                continue
            for lo, bucket in zip((0, *buckets), buckets):
                out.append((mode, kind, lo + 1, bucket))
        return out

    def capture_keys(self) -> list[Route]:
        """Graphs to capture, largest first (token-keyed graphs serve decode and extend alike)."""
        keys = {(mode, bucket) for mode, _, _, bucket in self.routes()}
        return sorted(keys, key=lambda k: (-k[1], k[0] is not ExecMode.FULL))

    def route(self, fb: ForwardBatch) -> Route | None:
        """``(mode, bucket)`` for this batch, or None to run it eagerly."""
        if fb.batch_size == 0 or fb.forward_mode.is_idle():
            return None
        if fb.forward_mode.is_decode():
            mode, bucket = self.plan.decode, next_bucket(self.decode_buckets, fb.batch_size)
        else:
            mode, bucket = self.plan.extend, next_bucket(self.extend_buckets, fb.num_tokens)
            if fb.batch_size > self.buffers.max_batch_size:
                bucket = None
        if mode is ExecMode.NONE:
            return None
        if bucket is None:
            self._count_fallback(fb)
            return None
        return mode, bucket

    def _count_fallback(self, fb: ForwardBatch) -> None:
        self.stats.eager_fallbacks += 1
        log = logger.debug if self._warned_fallback else logger.info
        self._warned_fallback = True
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
        if keys:
            self.backend.init_cuda_graph_state(self.buffers.max_batch_size, self.buffers.max_num_tokens)
        cuda = self.device.type == "cuda"
        pool = get_graph_pool() if cuda else None
        stream = torch.cuda.Stream(self.device) if cuda else None
        start = time.perf_counter()
        if cuda:  # torch.cuda.graph empties the cache per capture: start and end empty so only graphs count
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(self.device)[0] if cuda else 0
        with torch.inference_mode(), capture_session(self.device):
            for i, (mode, bucket) in enumerate(tqdm(keys, desc="capturing graphs", unit="graph", leave=False, disable=not keys)):
                begin = time.perf_counter()
                self._capture_one(mode, bucket, pool, stream)
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
        self.captured = True
        logger.info(
            "captured %d graphs (%s) in %.2f s (%s; the first graph, with the model's first call: %.2f s) using "
            "%.1f MiB of graph memory",
            len(keys),
            ", ".join(f"{m}: {n}" for m, n in sorted(self.stats.captures.items())) or "none",
            self.stats.capture_seconds,
            ", ".join(f"{m} {s:.2f} s" for m, s in sorted(self.stats.capture_seconds_by_mode.items())) or "-",
            self.stats.first_capture_seconds,
            self.stats.graph_memory_bytes / 2**20,
        )
        if warm_up:
            self.warm_up()
        if self.config.verify and keys:
            from compile_attn.graph_runner.verify import verify_runner

            verify_runner(self)
        return self.stats

    def warm_up(self, run: Callable[[ForwardBatch], Any] | None = None) -> int:
        """Run dummy batches of every shape class through ``run`` (default ``self.run``) after capture: cached
        prefixes, mixed steps, eager batches over the largest buckets, on a GPU every alignment of the step's index
        tensors (see ``graph_runner.warmup``). Step statistics are unchanged; returns the batches run."""
        from compile_attn.graph_runner.warmup import warm_up

        if not self.captured:
            raise RuntimeError("GraphRunner.warm_up() runs after capture(): call runner.capture() first")
        return warm_up(self, run)

    def _capture_one(self, mode: ExecMode, bucket: int, pool: Any, stream: Any) -> None:
        backend, model = self.backend, self.model
        full = mode is ExecMode.FULL
        fill = backend.get_cuda_graph_seq_len_fill_value()
        view = self.buffers.dummy_decode(bucket, fill) if full else self.buffers.dummy_extend(bucket)
        backend.init_forward_metadata_out_graph(view, in_capture=True)
        if not full:  # attention runs eagerly between pieces: its graph-side metadata is eager too
            backend.init_forward_metadata_in_graph(view)

        def step() -> Any:
            if full:
                backend.init_forward_metadata_in_graph(view)
            return model(view.input_ids, view.positions)

        with forward_context(view, backend, graph_mode=mode.value):
            if mode is ExecMode.PIECEWISE:  # the compile backend's wrappers warm up and capture this size
                step()
            else:
                step()  # warm-up: lazy initialisation (kernel compiles, library handles) happens outside the capture
                if full:
                    graph = capture_full(
                        step, device=self.device, pool=pool, stream=stream, traceable=not self.compiled
                    )
                else:
                    graph = capture_segments(step, device=self.device, pool=pool, stream=stream, breaks=True)
                self._graphs[(mode, bucket)] = graph
                self.stats.segments += graph.num_segments if not full else 0
                self.stats.breaks += graph.num_breaks
        self.stats.captures[mode.value] += 1

    # ------------------------------------------------------------------ run
    @torch.inference_mode()
    def run(self, fb: ForwardBatch) -> Any:
        """Run one step; returns the model output for the batch's real tokens.

        Capture and every step run under ``torch.inference_mode()``, whatever the caller's mode: the compiled
        model's Dynamo guards include the inputs' dispatch keys, which differ between inference-mode and
        no-grad tensors, so a step in another mode than capture would compile the model again (and capture its
        piecewise graphs again, on first use of each bucket)."""
        route = self.route(fb)
        if route is None:
            return self.run_eager(fb)
        fb.check(self.backend.kv_cache)  # a graph replay reads the batch unchecked: the eager entry's check here
        if not self.captured:
            raise RuntimeError(
                "GraphRunner.run() needs graphs: call runner.capture() once before the first step"
            )
        mode, bucket = route
        view = (
            self.views.decode_view(fb, bucket)
            if fb.forward_mode.is_decode()
            else self.views.extend_view(fb, bucket)
        )
        self.backend.init_forward_metadata_out_graph(view)
        if mode is not ExecMode.FULL:
            self.backend.init_forward_metadata_in_graph(view)
        with forward_context(view, self.backend, graph_mode=mode.value):
            if mode is ExecMode.PIECEWISE:
                out = self._call_piecewise(view)
            else:
                out = self._graphs[route].replay()
        self.stats.runs[mode.value] += 1
        return _slice_tokens(out, bucket, fb.num_tokens)

    def _skipping_guards(self) -> bool:
        """Whether calls of the compiled model run with Dynamo's guards off (``GraphConfig.skip_guards``): after
        capture, once the model has run (piecewise steps pass the static buffers that capture passed, so its graph
        exists), and unless a call showed that guards are needed."""
        return bool(self.captured and self.compiled and self._model_calls and self.config.skip_guards
                    and not self.config.verify and not self._guards_needed and _CAN_SKIP_GUARDS)

    def _guard_stance(self) -> contextlib.AbstractContextManager:
        """Dynamo guards off for a call of the compiled model where ``_skipping_guards``, else a no-op."""
        return _skip_guards() if self._skipping_guards() else contextlib.nullcontext()

    def _call_piecewise(self, fb: ForwardBatch) -> Any:
        """The compiled model on a piecewise bucket's static inputs: directly (``GraphConfig.direct_calls``)
        once a step of this bucket ran through Dynamo with guards skipped and allowed it."""
        tokens = fb.input_ids.shape[0]
        direct = self._direct_calls.get(tokens, _UNTRIED)
        if direct is None:  # looked for: the model allows none
            return self._call_model(fb, skip_guards=True)
        if direct is not _UNTRIED:
            self.stats.direct_calls += 1
            return direct()
        if not (self.config.direct_calls and self._skipping_guards()):
            return self._call_model(fb, skip_guards=True)
        with record_graph_calls() as calls:
            out = self._call_model(fb, skip_guards=True)
        direct = DirectCall.from_record(calls, out) if not self._guards_needed else None
        if direct is not None:
            self._direct_calls[tokens] = direct
        else:
            logger.debug("GraphRunner: no direct calls at %d tokens (the model ran %d graph(s), returned %s)",
                         tokens, len(calls), type(out).__name__)
            self._direct_calls[tokens] = None  # not tried again
        return out

    def _call_model(self, fb: ForwardBatch, skip_guards: bool) -> Any:
        """The model on ``fb``'s tokens; ``skip_guards``: without Dynamo's guard evaluation where allowed. Eager
        steps keep the guards: their inputs are the batch's own tensors (e.g. inference tensors where capture
        passed normal ones), which can need a graph of their own."""
        stance = self._guard_stance() if skip_guards else contextlib.nullcontext()
        try:
            with stance:
                out = self.model(fb.input_ids, fb.positions)
        except RuntimeError as exc:
            # torch refuses to recompile under skip_guard_eval_unsafe (it raises before running the new frame).
            # Run again with guards on, from now on: K/V stores of a partial first attempt are rewritten with the
            # same values.
            if isinstance(stance, contextlib.nullcontext) or "skip_guard_eval_unsafe" not in str(exc):
                raise
            logger.warning("GraphRunner: the compiled model needed a recompile with guards skipped (%s); "
                           "evaluating guards from now on", str(exc).splitlines()[0])
            self._guards_needed = True
            self._direct_calls.clear()  # they skip Dynamo entirely: not after a step showed it is needed
            out = self.model(fb.input_ids, fb.positions)
        self._model_calls += 1
        return out

    @torch.inference_mode()
    def run_eager(self, fb: ForwardBatch) -> Any:
        """Run one step without graphs (the reference the graphs are checked against)."""
        self.backend.init_forward_metadata(fb)
        with forward_context(fb, self.backend, graph_mode=ExecMode.NONE.value):
            out = self._call_model(fb, skip_guards=False)
        self.stats.runs[ExecMode.NONE.value] += 1
        return out


_CAN_SKIP_GUARDS = "skip_guard_eval_unsafe" in inspect.signature(torch.compiler.set_stance).parameters


_UNTRIED = object()  # a bucket whose direct call was not looked for yet


@contextlib.contextmanager
def _skip_guards() -> Iterator[None]:
    # Entered lazily: constructing torch.compiler.set_stance already switches the stance (it restores the
    # previous one on exit), so it must not be built outside the ``with``.
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        yield


def _slice_tokens(out: Any, bucket_tokens: int, real_tokens: int) -> Any:
    if isinstance(out, torch.Tensor):  # the common case, without pytree's walk
        return out[:real_tokens] if out.dim() and out.shape[0] == bucket_tokens else out

    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == bucket_tokens:
            return x[:real_tokens]
        return x

    return pytree.tree_map(cut, out)
