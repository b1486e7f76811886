"""Graph runner: the GraphRunner (buckets, static buffers, full / piecewise / breakable CUDA graphs), mode
planning and the breakable capture. ``GraphMode`` is ``compile_attn.graph_mode``'s, re-exported here."""

from __future__ import annotations

from compile_attn.graph_mode import GraphMode
from compile_attn.graph_runner.breakable import capture_segments
from compile_attn.graph_runner.plan import ModePlan, plan_modes
from compile_attn.graph_runner.replay_view import ReplayViews
from compile_attn.graph_runner.runner import GraphRunner
from compile_attn.graph_runner.segments import CapturedGraph, GraphCaptureError
from compile_attn.graph_runner.static_buffers import StaticBuffers
from compile_attn.graph_runner.stats import GraphRunnerStats
from compile_attn.graph_runner.verify import GraphVerificationError, verify_runner

__all__ = [
    "CapturedGraph",
    "GraphCaptureError",
    "GraphMode",
    "GraphRunner",
    "GraphRunnerStats",
    "GraphVerificationError",
    "ModePlan",
    "ReplayViews",
    "StaticBuffers",
    "capture_segments",
    "plan_modes",
    "verify_runner",
]
