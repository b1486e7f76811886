"""Graph runner: GraphMode, the GraphRunner (buckets, static buffers, full / piecewise / breakable
CUDA graphs) and the breakable capture.

``compile_attn.config`` imports ``graph_runner.mode``, so everything that needs the config is loaded
lazily on first attribute access to keep that import cycle-free.
"""

from __future__ import annotations

import importlib
from typing import Any

from compile_attn.graph_runner.memory_pool import get_graph_pool
from compile_attn.graph_runner.mode import GraphMode

_LAZY = {
    "GraphRunner": "compile_attn.graph_runner.runner",
    "GraphRunnerStats": "compile_attn.graph_runner.stats",
    "ExecMode": "compile_attn.graph_runner.plan",
    "ModePlan": "compile_attn.graph_runner.plan",
    "plan_modes": "compile_attn.graph_runner.plan",
    "StaticBuffers": "compile_attn.graph_runner.static_buffers",
    "ReplayViews": "compile_attn.graph_runner.replay_view",
    "capture_segments": "compile_attn.graph_runner.breakable",
    "CapturedGraph": "compile_attn.graph_runner.segments",
    "GraphCaptureError": "compile_attn.graph_runner.segments",
    "GraphVerificationError": "compile_attn.graph_runner.verify",
    "verify_runner": "compile_attn.graph_runner.verify",
}

__all__ = [
    "CapturedGraph",
    "ExecMode",
    "GraphCaptureError",
    "GraphMode",
    "GraphRunner",
    "GraphRunnerStats",
    "GraphVerificationError",
    "ModePlan",
    "ReplayViews",
    "StaticBuffers",
    "capture_segments",
    "get_graph_pool",
    "plan_modes",
    "verify_runner",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'compile_attn.graph_runner' has no attribute {name!r}")
