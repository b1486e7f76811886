"""GraphRunnerStats: counters a test or a log line can read (captures, runs per mode, fallbacks, memory)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class GraphRunnerStats:
    """What the runner did. Counter keys are the values of the GraphModes steps run in: "full", "piecewise",
    "breakable", "none".

    captures: graphs captured per mode (piecewise: one dummy run per bucket, the compile backend
    captures inside it). runs: steps run per mode; "none" counts every eager step, fallbacks included.
    eager_fallbacks: steps that wanted a graph but fit no bucket. segments / breaks: CUDA graph
    segments and eager split-op calls across all breakable graphs. verified: buckets checked by verify.
    capture_seconds: the whole capture; capture_seconds_by_mode: its split per mode; first_capture_seconds: the
    first graph (the largest bucket), which includes the first call of a compiled model (Dynamo's trace and
    the compile, or the load of cached pieces). direct_calls: piecewise steps that called the compiled graph
    directly, without Dynamo's frame (``GraphConfig.direct_calls``). shared_prefix_runs: decode steps with
    shared-prefix groups run piecewise for the backend's shared-prefix kernels (``GraphRunner.shared_prefix_route``).
    verify_graphs / verify_runs: full verify graphs captured and verify steps replayed in them (chains; draft trees
    too where the graphs are tree verify graphs, ``GraphConfig.verify_trees``) (both also
    counted in ``captures`` / ``runs`` under "full"; ``GraphRunner.verify_route``).
    """

    captures: Counter = field(default_factory=Counter)
    runs: Counter = field(default_factory=Counter)
    eager_fallbacks: int = 0
    segments: int = 0
    breaks: int = 0
    verified: int = 0
    capture_seconds: float = 0.0
    capture_seconds_by_mode: Counter = field(default_factory=Counter)
    first_capture_seconds: float = 0.0
    graph_memory_bytes: int = 0
    direct_calls: int = 0
    shared_prefix_runs: int = 0
    verify_graphs: int = 0
    verify_runs: int = 0
