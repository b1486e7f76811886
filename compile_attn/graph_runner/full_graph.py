"""Full capture: the whole step (``init_forward_metadata_in_graph`` + the model forward, attention
included) as one CUDA graph in the shared pool.

On CPU the same capture is emulated with an op tape (attention's body recorded like a CUDA graph
would record its kernels), or, for torch.compile'd models that a tape cannot trace, by re-running.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from compile_attn.graph_runner.breakable import capture_segments
from compile_attn.graph_runner.segments import CapturedGraph, CudaSegment, RerunGraph, weak_ref_tree


def capture_full(
    fn: Callable[[], Any], *, device: torch.device, pool: Any, stream: Any, traceable: bool
) -> CapturedGraph | RerunGraph:
    """Capture ``fn()`` as one graph. ``traceable=False`` (compiled models) re-runs ``fn`` on CPU."""
    if device.type == "cuda":
        segment = CudaSegment(pool)
        with torch.cuda.graph(segment.graph, pool=pool, stream=stream):
            out = fn()
        return CapturedGraph([segment], weak_ref_tree(out))
    if traceable:
        return capture_segments(fn, device=device, breaks=False)
    fn()
    return RerunGraph(fn)
