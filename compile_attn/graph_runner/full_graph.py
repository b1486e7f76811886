"""Full capture: the whole step (``init_forward_metadata_in_graph`` + the model forward, attention
included) as one CUDA graph in the shared pool.

On CPU the same capture is emulated with an op tape (attention's body recorded like a CUDA graph
would record its kernels), or, for torch.compile'd models that a tape cannot trace, by re-running.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from compile_attn.compiler.cuda_graph import capture_graph, weak_ref_tree
from compile_attn.graph_runner.breakable import capture_segments
from compile_attn.graph_runner.segments import CapturedGraph, RerunGraph


def capture_full(
    fn: Callable[[], Any], *, device: torch.device, pool: Any, stream: Any, traceable: bool
) -> CapturedGraph | RerunGraph:
    """Capture ``fn()`` as one graph (the caller ran its warm-up). ``traceable=False`` (compiled models) re-runs
    ``fn`` on CPU."""
    if device.type == "cuda":
        graph, out = capture_graph(fn, pool=pool, stream=stream, warm_up=False, run=False)
        return CapturedGraph([graph], weak_ref_tree(out))
    if traceable:
        return capture_segments(fn, device=device, breaks=False)
    fn()
    return RerunGraph(fn)
