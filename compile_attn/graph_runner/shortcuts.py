"""Host-time shortcuts of the graph runner: how it calls a torch.compile'd model after capture.

Both are on only for compiled models, after capture, with ``config.host_shortcuts_enabled()`` (the one switch,
``$COMPILE_ATTN_HOST_SHORTCUTS``) and their own ``GraphConfig`` flags on, and off under ``verify``; results are
the same either way.

* Skipped guards (``GraphConfig.skip_guards``): calls run under
  ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``. Safe because ``CompiledModel`` compiles one graph
  for every token count and piecewise steps pass the static buffers capture passed. A call that would need a new
  graph makes torch raise a RuntimeError naming ``skip_guard_eval_unsafe`` (it refuses to recompile in that
  stance); the call is then run again with guards, which stay on from then on.
* Direct calls (``GraphConfig.direct_calls``): the first piecewise step of a bucket is recorded
  (``compiler.shortcuts.record_graph_calls``); when it ran one graph and returned that graph's output, later steps
  of the bucket call the graph itself (``DirectCall``), without Dynamo's frame.

Tied to torch internals: the ``skip_guard_eval_unsafe`` stance and the text of the error it raises (tests pin both).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from compile_attn.compiler.shortcuts import DirectCall, record_graph_calls
from compile_attn.env import host_shortcuts_enabled
from compile_attn.config import GraphConfig

if TYPE_CHECKING:
    from compile_attn.batch import ForwardBatch
    from compile_attn.graph_runner.stats import GraphRunnerStats

logger = logging.getLogger(__name__)

CAN_SKIP_GUARDS = "skip_guard_eval_unsafe" in inspect.signature(torch.compiler.set_stance).parameters
RECOMPILE_REFUSED = "skip_guard_eval_unsafe"  # in the message torch raises for a recompile under that stance
_UNTRIED = object()  # a bucket whose direct call was not looked for yet


@contextlib.contextmanager
def skipped_guards() -> Iterator[None]:
    # Entered lazily: constructing torch.compiler.set_stance already switches the stance (it restores the
    # previous one on exit), so it must not be built outside the ``with``.
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        yield


class ModelCalls:
    """Calls ``model(input_ids, positions)`` for the runner: plainly, or after capture through the shortcuts."""

    def __init__(self, model: Any, config: GraphConfig, stats: GraphRunnerStats, *, compiled: bool) -> None:
        self.model = model
        self.stats = stats
        self.skip_guards = bool(compiled and config.skip_guards and not config.verify and CAN_SKIP_GUARDS
                                and host_shortcuts_enabled())
        self.direct_calls = self.skip_guards and config.direct_calls
        self.armed = False  # set once the runner has captured
        self.count = 0  # calls through run / run_eager (not capture)
        self.guards_needed = False  # set if a call with guards skipped had to recompile
        self.direct: dict[int, DirectCall | None] = {}  # per piecewise bucket (tokens); None: the model allows none

    def skipping_guards(self) -> bool:
        """Whether the next call runs with Dynamo's guards off: after capture, once the model has run (piecewise
        steps pass the static buffers that capture passed, so its graph exists), unless a call needed guards."""
        return self.skip_guards and self.armed and self.count > 0 and not self.guards_needed

    def guard_stance(self) -> contextlib.AbstractContextManager:
        """Dynamo guards off where ``skipping_guards``, else a no-op."""
        return skipped_guards() if self.skipping_guards() else contextlib.nullcontext()

    def piecewise(self, fb: ForwardBatch) -> Any:
        """The model on a piecewise bucket's static inputs: directly once a step of this bucket ran through Dynamo
        with guards skipped and allowed it."""
        tokens = fb.input_ids.shape[0]
        direct = self.direct.get(tokens, _UNTRIED)
        if direct is None:  # looked for: the model allows none
            return self(fb, skip_guards=True)
        if direct is not _UNTRIED:
            self.stats.direct_calls += 1
            return direct()
        if not (self.direct_calls and self.skipping_guards()):
            return self(fb, skip_guards=True)
        with record_graph_calls() as calls:
            out = self(fb, skip_guards=True)
        direct = DirectCall.from_record(calls, out) if not self.guards_needed else None
        if direct is None:
            logger.debug("GraphRunner: no direct calls at %d tokens (the model ran %d graph(s), returned %s)",
                         tokens, len(calls), type(out).__name__)
        self.direct[tokens] = direct  # None: not tried again
        return out

    def __call__(self, fb: ForwardBatch, skip_guards: bool) -> Any:
        """The model on ``fb``'s tokens; ``skip_guards``: without Dynamo's guard evaluation where allowed. Eager
        steps keep the guards: their inputs are the batch's own tensors (e.g. inference tensors where capture
        passed normal ones), which can need a graph of their own."""
        stance = self.guard_stance() if skip_guards else contextlib.nullcontext()
        try:
            with stance:
                out = self.model(fb.input_ids, fb.positions)
        except RuntimeError as exc:
            # Run again with guards, from now on: K/V stores of a partial first attempt are rewritten with the
            # same values.
            if isinstance(stance, contextlib.nullcontext) or RECOMPILE_REFUSED not in str(exc):
                raise
            logger.warning("GraphRunner: the compiled model needed a recompile with guards skipped (%s); "
                           "evaluating guards from now on", str(exc).splitlines()[0])
            self.guards_needed = True
            self.direct.clear()  # they skip Dynamo entirely: not after a step showed it is needed
            out = self.model(fb.input_ids, fb.positions)
        self.count += 1
        return out
